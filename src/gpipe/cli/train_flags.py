"""``gpipe train``'s flags, by group: the model, the pipeline, training, the run folder."""

from __future__ import annotations

from typing import Any

from gpipe.cli.common import multi_stage_schedules
from gpipe.schedules import SCHEDULES, SEQ_CHUNKED

__all__ = [
    "add_model_options",
    "add_pipeline_options",
    "add_run_folder_options",
    "add_training_options",
]


def add_model_options(model: Any) -> None:
    model.add_argument(
        "--model",
        help="what to train: gpt (the built-in GPT, the default), hf:PATH (a Hugging Face "
        "causal LM from a config.json, random weights, or from a model folder with its "
        "weights), or MODULE:FUNCTION (a factory returning an nn.Module that maps token ids "
        "to logits, imported from this folder or the installed packages)",
    )
    model.add_argument(
        "--split-at",
        metavar="NAME,...",
        help="where the stages of a traced model begin, by submodule name (such as "
        "model.layers.4); default: cut by --balance",
    )
    model.add_argument("--preset", help="the GPT's named size (default: small)")
    model.add_argument("--n-layer", type=int, help="transformer blocks")
    model.add_argument("--d-model", type=int, help="width of the residual stream")
    model.add_argument("--n-head", type=int, help="attention heads")
    model.add_argument("--d-ff", type=int, help="width of the MLP (default 4 x d-model)")
    model.add_argument("--context", type=int, help="longest sequence the model takes")
    model.add_argument("--dropout", type=float, help="dropout probability")
    model.add_argument(
        "--untied", action="store_true", help="separate embedding and LM-head weights"
    )


def add_pipeline_options(pipe: Any) -> None:
    pipe.add_argument("--stages", type=int, help="pipeline stages, one process each (default 2)")
    pipe.add_argument(
        "--data-parallel",
        type=int,
        metavar="D",
        help="replicas of the pipeline, D x stages processes in all; --batch-size is split "
        "among them (default 1)",
    )
    pipe.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="T",
        help="ranks each stage's layers are split over (the GPT's attention heads, MLP and "
        "vocabulary), T x stages x data-parallel processes in all; the T ranks of a stage read "
        "the same rows (default 1)",
    )
    pipe.add_argument(
        "--shard",
        choices=["none", "optimizer", "gradients", "full"],
        help="with --data-parallel: full splits each stage's parameters, gradients and "
        "optimizer state over its replicas (PyTorch's fully_shard); default none, whole "
        "copies on every replica",
    )
    pipe.add_argument("--chunks", type=int, help="micro-batches per mini-batch (default 8)")
    pipe.add_argument("--checkpoint", help="re-materialization: always, except_last, never")
    pipe.add_argument(
        "--compile",
        action="store_true",
        help="compile each layer with torch.compile (not with --tensor-parallel or --shard); "
        "under a schedule that splits the backward (the zero-bubble family) the layers train "
        "eager, keeping the split, and run compiled in evaluation",
    )
    pipe.add_argument(
        "--compile-backend",
        metavar="NAME",
        help="torch.compile's backend for --compile (default inductor; aot_eager compiles "
        "the same graphs without generating code)",
    )
    pipe.add_argument(
        "--seq-chunks",
        type=int,
        metavar="S",
        help="cut each micro-batch along its sequence into S sub-sequences that follow each "
        "other through the pipeline (Seq1F1B): a stage keeps a sub-sequence's activations, "
        f"not a micro-batch's; with --schedule {', '.join(SEQ_CHUNKED)} (default 1)",
    )
    pipe.add_argument(
        "--seq-split",
        choices=["even", "balanced"],
        help="with --seq-chunks: sub-sequences of equal length (even, the default; S divides "
        "--seq-len) or of equal cost (balanced: later ones attend to more tokens, so are shorter)",
    )
    pipe.add_argument(
        "--schedule",
        help=f"pipeline schedule: {', '.join(SCHEDULES)}, or auto: the schedule, its stages "
        "per process, --chunks (unless given) and the cut that the simulator predicts fastest "
        "from the layers' measured times within the device's memory (default gpipe)",
    )
    pipe.add_argument(
        "--virtual-stages",
        type=int,
        help=f"stages per process with --schedule {multi_stage_schedules()}",
    )
    pipe.add_argument(
        "--balance",
        help="where to cut: time (measured, the default), params, even, or layers per stage "
        "such as 3,3",
    )
    pipe.add_argument("--device", choices=["cpu", "cuda"], help="where stages run (default cpu)")
    pipe.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        help="fp32 (the default), or mixed precision: bf16 under autocast, fp16 under "
        "autocast with loss scaling",
    )
    pipe.add_argument(
        "--threads",
        type=int,
        help="intra-op threads per process on CPU (default: this machine's cores shared "
        "among its processes)",
    )


def add_training_options(run: Any) -> None:
    run.add_argument("--steps", type=int, help="optimizer steps in all (default 200)")
    run.add_argument("--batch-size", type=int, help="sequences per mini-batch (default 32)")
    run.add_argument("--seq-len", type=int, help="training sequence length (default: --context)")
    run.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    run.add_argument("--warmup", type=int, help="warm-up steps (default 30)")
    run.add_argument("--eval-every", type=int, help="steps between validation losses")
    run.add_argument(
        "--save-every", type=int, help="steps between checkpoints (default 50; 0: at the end)"
    )
    run.add_argument(
        "--keep",
        type=int,
        metavar="N",
        help="checkpoints kept: the newest N that verify (default 3); older ones are removed "
        "once a newer one has verified",
    )
    run.add_argument(
        "--keep-every",
        type=int,
        metavar="S",
        help="also keep for good the checkpoints at multiples of S steps (default 0: none)",
    )
    run.add_argument(
        "--sync-save",
        action="store_true",
        help="write checkpoints while training waits (default: in the background, from a "
        "copy of the state in CPU memory)",
    )
    run.add_argument(
        "--save-writer",
        choices=["auto", "process", "thread"],
        help="what writes a checkpoint in the background: a helper process per rank, a "
        "thread, or (auto, the default) a helper process where a rank's state is 64 MiB or "
        "more (docs/train.md, Saves in the background)",
    )
    run.add_argument(
        "--data",
        help="what to train on: a text file or folder (bytes, or tokens with --tokenizer), "
        "JSON lines with a text field, or token ids in a .bin (see --token-dtype) or .npy "
        "file, memory-mapped (default: this Python's standard library's sources)",
    )
    run.add_argument(
        "--val-data", help="held-out data for the validation loss (default: the last 10%%)"
    )
    run.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer.json or a Hugging Face tokenizer folder for text data",
    )
    run.add_argument(
        "--token-dtype",
        choices=["uint16", "uint32"],
        help="the ids' type in a .bin token file (default uint16)",
    )
    run.add_argument(
        "--pack",
        action="store_true",
        help="train on whole documents of a JSON lines --data, packed into micro-batches of "
        "near-equal tokens, attention kept within each document (docs/varlen.md)",
    )
    run.add_argument("--seed", type=int, help="seed of weights, data order and dropout")
    run.add_argument("--timeout", type=float, help="seconds a stage waits for a neighbour")
    run.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="restart the processes up to N times when one is lost, each time continuing "
        "from the newest good checkpoint (default 0; under torchrun, torchrun's own flag)",
    )
    run.add_argument("--prompt", help="start of the sample printed at the end")
    run.add_argument(
        "--sample-tokens", type=int, help="bytes to generate at the end (0: no sample)"
    )


def add_run_folder_options(out: Any) -> None:
    out.add_argument("--out", help="run folder (default runs/gpt)")
    out.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint")
    out.add_argument("--force", action="store_true", help="replace what is in the run folder")
    out.add_argument("--quiet", action="store_true", help="plain log lines, no progress bar")
    out.add_argument(
        "--report-to",
        metavar="none|tensorboard|wandb",
        help="also log metrics.jsonl's metrics to TensorBoard (in the run folder's "
        "tensorboard/) or Weights & Biases, or both, comma-separated (default none)",
    )
    out.add_argument(
        "--trace",
        action="store_true",
        help="write the last step's timeline (trace.json, timeline.png, view.html) into the "
        "run folder",
    )
