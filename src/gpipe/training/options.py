"""The training job's settings: how to train, and what each rank is handed to run its stage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PRECISIONS", "RunSpec", "TrainOptions"]

# autocast's dtype for each --precision; None runs without autocast
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainOptions:
    """How to train; the model's shape lives in GPTConfig."""

    stages: int = 2
    data_parallel: int = 1  # replicas of the pipeline; --batch-size is split among them
    tensor_parallel: int = 1  # ranks each stage's layers are split over; they read the same rows
    shard: str = "none"  # full: each stage's states split over its replicas (fully_shard)
    chunks: int | None = 8  # None: chosen by --schedule auto
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    virtual_stages: int = 1  # stages per process, for the looped schedules (a V holds two)
    balance: str = "time"  # time, params, even, or layers per stage such as "3,3"
    steps: int = 200
    batch_size: int = 32
    seq_len: int | None = None  # default: the model's maximum
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 50  # 0: only at the end; docs/train.md says why 50
    keep: int = 3  # the newest verified checkpoints kept; older ones are removed
    keep_every: int = 0  # checkpoints at multiples of this many steps are kept for good
    sync_save: bool = False  # training waits while a checkpoint is written
    save_writer: str = "auto"  # in the background: process, thread, or auto (by state size)
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"  # fp32, bf16 (autocast) or fp16 (autocast and loss scaling)
    data: str | None = None
    val_data: str | None = None  # default: the last tenth of --data
    tokenizer: str | None = None  # text as bytes without one
    token_dtype: str = "uint16"  # of a .bin token file
    pack: bool = False  # --data's documents packed into micro-batches of near-equal tokens
    timeout: float = 300.0
    sample_tokens: int = 300
    prompt: str = "def "
    quiet: bool = False
    report_to: str = "none"  # where metrics.jsonl's records also go: tensorboard, wandb, both
    trace: bool = False  # write the last step's timeline into the run folder
    compile: bool = False  # each layer compiled with torch.compile
    compile_backend: str = "inductor"  # torch.compile's backend
    seq_chunks: int = 1  # each micro-batch cut along its sequence into this many (Seq1F1B)
    seq_split: str = "even"  # sub-sequences of equal length, or of equal cost (balanced)

    @property
    def parts(self) -> int:
        """Stages of the whole pipeline: ``virtual_stages`` per process under a looped
        schedule, two under a V, one otherwise (and under ``--schedule auto``, until it has
        chosen)."""
        from gpipe.schedules import traits

        if self.schedule == "auto":
            return self.stages

        return self.stages * traits(self.schedule).stages_per_rank(self.virtual_stages)


@dataclass
class RunSpec:
    """Everything a rank needs to run its stage; small and picklable for new processes."""

    model: dict[str, Any]
    train: dict[str, Any]
    out: str
    resume: bool = False  # continue from the newest checkpoint that verifies; one must
    restarted: bool = False  # the job was here before: continue from one if any verifies
    checkpoint: str | None = None  # the one the launching command verified, for --resume
    extra: dict[str, Any] = field(default_factory=dict)
