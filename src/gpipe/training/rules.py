"""The rules a run's options must satisfy, checked before any process starts: counts that
must be positive, a schedule's micro-batch rules, a cut the model allows, shards with
replicas to shard over. Each broken rule is one ``ConfigError`` naming the flag, what was
given and what is expected."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpipe.errors import ConfigError, counted
from gpipe.runtime.compiled import check_backend
from gpipe.runtime.recompute import check_checkpoint
from gpipe.schedules import SCHEDULES, SEQ_CHUNKED, Placement, traits
from gpipe.training.config import TrainConfig
from gpipe.training.models.resolve import model_layer_count
from gpipe.training.options import TrainOptions
from gpipe.training.trackers import check_report_to

if TYPE_CHECKING:
    from gpipe.training.models.sources import TrainModel

__all__ = [
    "check_options",
    "check_run_folder",
    "check_v_stages",
    "multi_stage_schedules",
    "positive",
]


# The step's dropout seed is --seed x 1_000_003 plus the step's count, and PyTorch takes
# seeds of 64 bits: a larger --seed would fail in every process once they have started.
_SEED_BOUND = 1 << 40


def positive(name: str, value: Any) -> None:
    """Refuse ``--name value`` unless it is unset or at least 1."""
    if value is not None and value < 1:
        raise ConfigError(f"--{name} must be a positive integer, got {value}")


def check_run_folder(config: TrainConfig) -> None:
    """``--resume DIR`` continues the run in DIR, there: ``--force`` (replace the folder) or
    an ``--out`` naming another folder would be ignored, so each is refused instead."""
    if config.resume is None:
        return
    if config.force:
        raise ConfigError(
            f"--force replaces the run folder and --resume {config.resume} continues it: "
            "give one of them"
        )
    if (
        config.out != TrainConfig().out
        and Path(config.out).resolve() != Path(config.resume).resolve()
    ):
        raise ConfigError(
            f"--out {config.out} with --resume {config.resume}: a resumed run goes on in its "
            "own folder; leave --out out, or give it the same folder"
        )


def multi_stage_schedules() -> str:
    """The registered schedules that place several stages on each rank, as ``--schedule``
    values for a message: ``interleaved``, or ``a or b``."""
    return " or ".join(name for name in SCHEDULES if traits(name).several_stages_per_rank)


def check_v_stages(schedule: str, virtual_stages: int | None) -> None:
    """Refuse ``--virtual-stages`` other than a V schedule's own count (None: not given),
    which the V would otherwise ignore: it holds two stages per process whatever is asked."""
    kind = traits(schedule)
    if kind.placement is not Placement.V or virtual_stages is None:
        return
    held = kind.stages_per_rank(virtual_stages)
    if virtual_stages != held:
        raise ConfigError(
            f"--schedule {schedule} places two stages per process in a V: --virtual-stages "
            f"is {held}, got {virtual_stages}"
        )


def _check_seq_chunks(opts: TrainOptions, seq_len: int, model: TrainModel) -> None:
    """--seq-chunks: a schedule that runs sub-sequences, nothing they do not run with, a
    --seq-len they cut evenly, and a Hugging Face model cut by its plan."""
    if opts.seq_chunks == 1:
        if opts.seq_split != "even":
            raise ConfigError(f"--seq-split {opts.seq_split} needs --seq-chunks of 2 or more")
        return
    s = opts.seq_chunks
    if opts.schedule not in SEQ_CHUNKED:
        raise ConfigError(
            f"--seq-chunks {s} runs with --schedule {', '.join(SEQ_CHUNKED)}, got {opts.schedule}"
        )
    if opts.pack:
        raise ConfigError(
            f"--seq-chunks {s} does not run with --pack yet (given, or the run's own)"
        )
    if seq_len < s:  # first: --seq-split balanced cannot cut it either
        raise ConfigError(f"--seq-chunks {s} is more than --seq-len {seq_len} tokens")
    if opts.seq_split == "even" and seq_len % s:
        raise ConfigError(
            f"--seq-chunks {s} does not divide --seq-len {seq_len}: give a multiple of {s}, "
            "or --seq-split balanced"
        )
    if model.kind == "hf" and model.hf_config is not None:
        from gpipe.training.hf.models import hf_config

        config = hf_config(model.hf_config)
        if not getattr(config, "base_model_pp_plan", None):  # traced: stages keep no cache
            raise ConfigError(
                f"--seq-chunks {s} with --model {model.source}: sub-sequences need a causal "
                "LM whose stages hold its own layers, cut by the pipeline plan its config "
                f"declares (base_model_pp_plan); {config.model_type} declares none"
            )


def _check_ranges(opts: TrainOptions) -> None:
    """Each number within its own range, whatever the others say: counts of at least 1,
    intervals of at least 0, a finite learning rate, a positive timeout and a seed whose
    derived seeds PyTorch takes."""
    for name in (
        "stages",
        "data_parallel",
        "tensor_parallel",
        "chunks",
        "steps",
        "batch_size",
        "seq_len",
        "eval_every",
        "virtual_stages",
        "seq_chunks",
    ):
        positive(name.replace("_", "-"), getattr(opts, name))
    for name in ("warmup", "save_every", "keep_every", "sample_tokens"):
        if getattr(opts, name) < 0:
            flag = name.replace("_", "-")
            raise ConfigError(f"--{flag} must not be negative, got {getattr(opts, name)}")
    if opts.keep < 1:
        raise ConfigError(
            f"--keep must be at least 1 (the newest good checkpoint), got {opts.keep}"
        )
    if not (math.isfinite(opts.lr) and opts.lr >= 0):
        raise ConfigError(f"--lr must be a finite number, 0 or more, got {opts.lr}")
    if not (math.isfinite(opts.timeout) and opts.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {opts.timeout}")
    if not -_SEED_BOUND <= opts.seed < _SEED_BOUND:  # derived seeds must fit PyTorch's
        raise ConfigError(
            f"--seed must be an integer from {-_SEED_BOUND} to {_SEED_BOUND - 1} (2**40 - 1), "
            f"got {opts.seed}"
        )


def check_options(model: TrainModel, opts: TrainOptions) -> None:
    """ConfigError for the first rule ``opts`` breaks for ``model``."""
    _check_ranges(opts)
    if opts.sync_save and opts.save_writer != "auto":
        raise ConfigError(
            f"--save-writer {opts.save_writer} (given, or the run's own) says what writes in "
            "the background, but --sync-save writes with training stopped: give one of them"
        )
    if opts.save_writer == "process" and opts.tensor_parallel > 1:
        raise ConfigError(
            f"--save-writer process (given, or the run's own): a helper process cannot write "
            f"the split (DTensor) state of --tensor-parallel {opts.tensor_parallel}; write by a "
            "thread (--save-writer thread or auto)"
        )
    if opts.compile and (opts.tensor_parallel > 1 or opts.shard != "none"):
        raise ConfigError(
            "--compile is not supported with --tensor-parallel or --shard yet (given, or the "
            "run's own): leave one of them out"
        )
    if opts.compile_backend != "inductor" and not opts.compile:
        raise ConfigError(f"--compile-backend {opts.compile_backend} needs --compile")
    if opts.compile:
        _check_compile_backend(opts.compile_backend)
    _check_seq_chunks(opts, opts.seq_len if opts.seq_len is not None else model.seq_len, model)
    layers = model_layer_count(model)
    if opts.batch_size < opts.data_parallel:
        raise ConfigError(
            f"--batch-size {opts.batch_size} cannot give each of --data-parallel "
            f"{opts.data_parallel} replicas a row"
        )
    if layers is not None and opts.stages > layers:
        which = (
            f"{layers} layers ({layers - 2} blocks, embedding and head)"
            if model.kind == "gpt"
            else f"{layers} decoder layers (a stage holds one at least)"
        )
        raise ConfigError(
            f"--stages {opts.stages} is more than the model's {which}; at most {layers} stages"
        )
    if opts.seq_len is not None and opts.seq_len > model.seq_len:
        more = "raise --context" if model.kind == "gpt" else "its config says so"
        raise ConfigError(
            f"--seq-len {opts.seq_len} is above the model's maximum of {model.seq_len} ({more})"
        )
    _check_shard(opts)
    _check_tensor_parallel(model, opts)
    if model.kind == "hf" and opts.balance not in ("time", "params"):
        raise ConfigError(
            f"--balance {opts.balance}: a Hugging Face model is cut by tracing, by parameters "
            "(time and params both mean that on the meta device) or at --split-at NAME,..."
        )
    if opts.schedule == "auto":
        _check_auto(opts, model)
    else:
        _check_schedule(opts, layers)
    _check_chunks(opts)
    try:
        check_checkpoint(opts.checkpoint)
    except ValueError:
        raise ConfigError(
            "--checkpoint must be always, except_last or never, got " + repr(opts.checkpoint)
        ) from None
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but this machine has no CUDA device")
    check_report_to(opts.report_to)


def _check_shard(opts: TrainOptions) -> None:
    """``--shard``: only ``full`` exists, and only with replicas to shard over."""
    if opts.shard == "none":
        return
    from torch import nn

    from gpipe.parallel.sharding import check_shard

    try:
        check_shard(opts.shard, opts.data_parallel, nn.Sequential())
    except ValueError as exc:
        raise ConfigError(
            f"--shard {opts.shard} (with --data-parallel {opts.data_parallel}): {exc}"
        ) from None


def _check_tensor_parallel(model: TrainModel, opts: TrainOptions) -> None:
    """``--tensor-parallel T``: the plan the model's layers declare, checked on the meta
    device as the engine checks it (every size it splits divisible by T: heads, hidden
    sizes, the vocabulary). A model from a factory is built only in the processes, whose
    engine checks it there."""
    if opts.tensor_parallel == 1 or model.kind not in ("gpt", "hf"):
        return
    from gpipe.parallel.tensor import resolve_plan

    # a copy: splitting a Hugging Face model records its cut on the model it splits
    layers = copy.copy(model).layers(opts.parts, opts.seed, "params")
    try:
        resolve_plan(None, layers, opts.tensor_parallel)
    except ValueError as exc:
        raise ConfigError(f"--tensor-parallel {opts.tensor_parallel}: {exc}") from None


def _check_auto(opts: TrainOptions, model: TrainModel) -> None:
    """``--schedule auto`` chooses the stages per process and the cut itself."""
    if model.kind == "hf" or model.split_at:
        raise ConfigError(
            f"--schedule auto cuts an nn.Sequential between its layers; --model {model.source} "
            "is split by tracing: pass --schedule and --chunks"
        )
    if opts.virtual_stages > 1:
        raise ConfigError(
            f"--virtual-stages {opts.virtual_stages}: --schedule auto chooses the stages per "
            "process; leave it out"
        )
    if opts.balance != "time":
        raise ConfigError(
            f"--balance {opts.balance}: --schedule auto chooses the cut by time; leave it out"
        )


def _check_chunks(opts: TrainOptions) -> None:
    """A micro-batch is a row at least: ``--chunks`` above a replica's rows would run fewer
    micro-batches than asked (and than run.json records). With ``--pack`` the rows are
    tokens' worth, checked against the documents (``check_pack``)."""
    share = opts.batch_size // opts.data_parallel
    if opts.chunks is not None and opts.chunks > share and not opts.pack:
        raise ConfigError(
            f"--chunks {opts.chunks} is more than each replica's {counted(share, 'row')} of "
            f"--batch-size {opts.batch_size}: give --chunks {share} or fewer, or a larger "
            "--batch-size"
        )


def _check_schedule(opts: TrainOptions, layers: int | None) -> None:
    """A named schedule: its stages per process and micro-batch rules, and the cut."""
    from gpipe.training.balance_choice import parse_balance

    assert opts.chunks is not None  # None only under --schedule auto
    if opts.schedule not in SCHEDULES:
        raise ConfigError(
            f"--schedule must be auto or one of {', '.join(SCHEDULES)}, got {opts.schedule!r}"
        )
    schedule = traits(opts.schedule)
    check_v_stages(opts.schedule, None if opts.virtual_stages == 1 else opts.virtual_stages)
    if opts.virtual_stages > 1 and not schedule.several_stages_per_rank:
        raise ConfigError(
            f"--virtual-stages {opts.virtual_stages} needs --schedule {multi_stage_schedules()}, "
            f"not {opts.schedule}"
        )
    if schedule.microbatches_per_round and (
        opts.chunks % opts.stages or opts.batch_size // opts.data_parallel < opts.chunks
    ):
        raise ConfigError(
            f"--schedule {opts.schedule} needs --chunks a multiple of --stages ({opts.stages}) and "
            f"each replica's share of --batch-size at least --chunks, got --chunks "
            f"{opts.chunks} and --batch-size {opts.batch_size} over {opts.data_parallel} "
            "replica(s)"
        )
    fewest = schedule.fewest_microbatches(opts.stages, opts.virtual_stages)
    if not schedule.runs(opts.stages, opts.chunks, opts.virtual_stages):
        raise ConfigError(
            f"--schedule {opts.schedule} needs --chunks of at least {fewest} for --stages "
            f"{opts.stages}, got {opts.chunks}"
        )
    share = opts.batch_size // opts.data_parallel
    if share < fewest:  # a step runs as many micro-batches as a replica's share has rows
        raise ConfigError(
            f"--schedule {opts.schedule} runs at least {fewest} micro-batches for --stages "
            f"{opts.stages}: each replica's share of --batch-size must be at least {fewest} "
            f"rows, got {share} (--batch-size {opts.batch_size} over {opts.data_parallel} "
            "replica(s))"
        )
    if layers is not None and opts.parts > layers:
        raise ConfigError(
            f"--stages {opts.stages} x --virtual-stages {opts.virtual_stages} is more than the "
            f"model's {layers} layers ({layers - 2} blocks, embedding and head)"
        )
    if layers is None:
        return  # a split model: the ranks cut it where --split-at or the balance says
    try:
        parse_balance(opts.balance, opts.parts, layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_compile_backend(backend: str) -> None:
    try:
        check_backend(backend)
    except ValueError as exc:
        raise ConfigError(f"--compile-backend {backend}: {exc}") from None
