"""A run of ``gpipe train`` from Python: ``train(TrainConfig(...))`` resolves the model and
options (from the configuration, or from the run it continues), checks them and the data
before any process starts, prepares the run folder, and runs the stages: in local processes
it starts (restarting them after a lost one, ``max_restarts``), or as this process's rank
under torchrun. It prints progress and the summary as the command does and returns when the
run ends.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpipe.errors import ConfigError, counted
from gpipe.training.config import TrainConfig, config_values
from gpipe.training.models.resolve import GPT_FLAGS, check_pack, resolve_model, starting_weights
from gpipe.training.options import RunSpec, TrainOptions
from gpipe.training.rules import check_options, check_run_folder

if TYPE_CHECKING:
    from gpipe.training.models.sources import TrainModel

__all__ = [
    "RUN_FILE",
    "ResolvedRun",
    "layout_text",
    "resolve",
    "shape_from_world",
    "train",
    "under_torchrun",
]

RUN_FILE = "run.json"  # the run's model config and options, written when it starts


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (its variables are all set)."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _train_options(config: TrainConfig, saved: dict[str, Any] | None) -> TrainOptions:
    from gpipe.training.options import TrainOptions

    values = dict(saved or {})
    if saved is not None and config.pack and not saved.get("pack", False):
        raise ConfigError(
            "--pack: the run being continued trained on windows of the token stream; a run "
            "packs documents from its start or never (start a new run with --pack)"
        )
    for f in fields(TrainOptions):
        given = getattr(config, f.name, None)
        if given is not None and given is not False:
            values[f.name] = given
    for flag in ("quiet", "trace", "sync_save", "compile"):
        if getattr(config, flag):
            values[flag] = True
    for path in ("data", "val_data", "tokenizer"):  # the run is read from other folders too
        if getattr(config, path) is not None:
            values[path] = str(Path(getattr(config, path)).resolve())
    if config.seq_chunks == 1 and config.seq_split is None:
        values["seq_split"] = "even"  # the run's own split, of sub-sequences no longer cut
    if values.get("schedule") == "auto" and config.chunks is None and saved is None:
        values["chunks"] = None  # the search chooses it
    return TrainOptions(**values)


def _check_data(opts: TrainOptions, model: TrainModel, out: Path) -> None:
    """The data against the model, before any process starts: the tokenizer's vocabulary,
    the token ids, one window of each part. Text a tokenizer must turn into ids is checked
    once it is, in the run folder."""
    from gpipe.training.data.run_data import checked_documents, data_prepared, run_dataset
    from gpipe.training.data.tokenizer import check_tokenizer, load_tokenizer
    from gpipe.training.data.tokens import check_sources, check_vocabulary, check_windows

    try:
        check_sources(opts.data, opts.val_data, opts.token_dtype)
        if opts.tokenizer is not None:
            check_tokenizer(load_tokenizer(opts.tokenizer), model.vocab_size)
        if not data_prepared(opts, out):  # checked once the text is tokenized
            return
        if opts.pack:  # documents, each its own length: no window to fit
            dataset = checked_documents(opts, out)
        else:
            dataset = run_dataset(opts, out)
            check_windows(dataset, opts.seq_len or model.seq_len)
        check_vocabulary(dataset, model.vocab_size)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None


def _prepare_data(opts: TrainOptions, model: TrainModel, out: Path) -> None:
    """Tokenize text data once into the run folder, then check it as any data is."""
    from gpipe.training.data.run_data import prepare_run_data

    try:
        prepare_run_data(opts, out)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None
    _check_data(opts, model, out)


def _prepare_folder(out: Path, resume: bool, force: bool, run: dict[str, Any]) -> None:
    """Refuse to overwrite a run unless told to; record what this run is. A folder that
    cannot be written is refused in one line."""
    from gpipe.training.run_lock import LOCK_FILE

    found = [p for p in out.iterdir() if p.name != LOCK_FILE] if out.is_dir() else []
    if not resume and found:
        if not force:
            raise ConfigError(
                f"run folder {out} is not empty; pass --force to replace it, "
                f"or --resume {out} to continue it"
            )
        if out.is_symlink():  # never empty a folder through a link: it may be anyone's
            raise ConfigError(
                f"--out {out} is a link to {out.resolve()}: --force empties a run folder only "
                "when given the folder itself"
            )
        for path in found:  # the lock stays: this run holds it
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
        temporary = out / f".{RUN_FILE}.tmp"  # renamed: a restart never reads half of it
        temporary.write_text(json.dumps(run, indent=2) + "\n")
        os.replace(temporary, out / RUN_FILE)
    except OSError as exc:
        flag = "--resume" if resume else "--out"
        raise ConfigError(
            f"{flag} {out}: cannot write the run folder ({exc.strerror}: {exc.filename})"
        ) from None


def _saved_run(config: TrainConfig) -> dict[str, Any] | None:
    if config.resume is None:
        return None
    from gpipe.training.checkpoints.format import checkpoint_dirs, verify_checkpoint
    from gpipe.training.checkpoints.resuming import check_outputs_unlinked

    folder = Path(config.resume)
    # Sizes only here; the processes check every file's SHA-256 before they load one.
    whole = any(
        not verify_checkpoint(p, checksums=False) for p in checkpoint_dirs(folder / "checkpoints")
    )
    if not (folder / RUN_FILE).is_file() or not whole:
        raise ConfigError(f"--resume {folder}: no gpipe run with a complete checkpoint there")
    try:
        check_outputs_unlinked(folder)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return _run_record(folder / RUN_FILE)


def _verified_checkpoint(out: Path) -> str:
    """The newest checkpoint of the run being resumed that verifies whole and safe to open,
    found before any process starts (each newer one is warned of and skipped), so that a run
    with none ends in one line naming each checkpoint and why."""
    from gpipe.training.checkpoints.format import (
        DamagedCheckpointWarning,
        checkpoint_dirs,
        verify_checkpoint,
    )

    refused: list[tuple[str, str]] = []
    for path in reversed(checkpoint_dirs(out / "checkpoints")):
        problems = verify_checkpoint(path, run=True)
        if not problems:
            for name, why in refused:
                skipped = out / "checkpoints" / name
                warning = f"checkpoint {skipped} is damaged ({why}); skipped for an older one"
                warnings.warn(warning, DamagedCheckpointWarning, stacklevel=1)
            return path.name
        refused.append((path.name, "; ".join(problems)))
    listed = "; ".join(f"{name}: {why}" for name, why in refused)
    raise ConfigError(f"--resume {out}: no checkpoint there can be opened ({listed})")


def _run_record(path: Path) -> dict[str, Any]:
    """The run recorded in ``path``, checked field by field (a run folder may come from
    anyone); one line if it is not a record gpipe wrote."""
    from gpipe.training.run_record import checked_run_record

    try:
        return checked_run_record(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _this_jobs_run(out: Path) -> dict[str, Any] | None:
    """The run in ``out`` if this torchrun job started it: the job is being restarted (after
    a lost process, or to admit or drop a machine) and continues it."""
    from gpipe.training.elastic import job_id

    if not (out / RUN_FILE).is_file():
        return None
    run = _run_record(out / RUN_FILE)
    job = job_id()
    return run if job is not None and run.get("job") == job else None


def _agree_on_folder(
    prepare: Callable[[], None], device: str, timeout: float, restarted: bool
) -> bool:
    """Under torchrun, rank 0 prepares the run folder and every rank learns the outcome (a
    ConfigError there is every rank's), and whether rank 0 found the job restarted (a rank
    that read the folder after rank 0 had written it could think so wrongly); returns that."""
    from gpipe.comm.agreement import on_first_rank
    from gpipe.comm.process_group import rank_device
    from gpipe.training.elastic import join_process_group

    join_process_group(rank_device(device), timeout)

    def prepared() -> bool:
        prepare()
        return restarted

    return on_first_rank(prepared, None, "preparing the run folder", passed_on=(ConfigError,))


@dataclass
class ResolvedRun:
    """A configuration as it will run: the model, the options every rank takes, the run
    folder, and the configuration with every field filled in."""

    config: TrainConfig
    model: TrainModel
    options: TrainOptions
    out: Path
    held: dict[str, Any] | None  # the run this torchrun job started, when it is restarted


def resolve(config: TrainConfig) -> ResolvedRun:
    """What ``config`` runs, checked: the model and options from the configuration, or from
    the run it continues where it leaves them unset. ConfigError for anything that cannot
    run. Reads the run folder, writes nothing."""
    if not isinstance(config, TrainConfig):
        raise TypeError(
            f"config must be a gpipe.training.TrainConfig, got {type(config).__name__} "
            "(TrainConfig.from_dict turns a dict of flags into one)"
        )
    config.check()  # its fields may have been set since it was made
    torchrun = under_torchrun()
    if torchrun and config.max_restarts is not None:
        raise ConfigError(
            f"--max-restarts {config.max_restarts}: under torchrun, restarts are torchrun's; "
            "pass torchrun --max-restarts instead"
        )
    if config.max_restarts is not None and config.max_restarts < 0:
        raise ConfigError(f"--max-restarts must not be negative, got {config.max_restarts}")
    if config.threads is not None and config.threads < 1:
        raise ConfigError(f"--threads must be a positive integer, got {config.threads}")
    check_run_folder(config)
    out = Path(config.resume or config.out)
    if config.resume is None and out.exists() and not out.is_dir():
        raise ConfigError(f"--out {config.out} is a file; expected a run folder (a directory)")
    held = _this_jobs_run(out) if torchrun else None
    saved = held or _saved_run(config)
    model = resolve_model(config, saved and saved["model"], out)
    opts = _train_options(config, saved and saved["train"])
    if torchrun:
        shape_from_world(config, opts, int(os.environ["WORLD_SIZE"]))
    check_options(model, opts)
    check_pack(opts, model)
    return ResolvedRun(_resolved_config(config, model, opts), model, opts, out, held)


def _resolved_config(config: TrainConfig, model: TrainModel, opts: TrainOptions) -> TrainConfig:
    """``config`` with every field as the run will use it: the model's shape and the options
    resolved, defaults filled in."""
    values: dict[str, Any] = {
        "model": model.source,
        "split_at": ",".join(model.split_at) if model.split_at else None,
    }
    if model.kind == "gpt":
        shape = model.config
        values |= {flag: getattr(shape, name) for flag, name in GPT_FLAGS.items()}
        values["untied"] = not shape.tied
    names = {f.name for f in fields(TrainConfig)}
    values |= {k: v for k, v in asdict(opts).items() if k in names}
    for name in ("out", "resume", "threads", "max_restarts", "force"):
        values[name] = getattr(config, name)
    if config.resume is not None:  # the run lives where it is continued, whatever --out says
        values["out"] = config.resume
    return TrainConfig(**values)


def train(config: TrainConfig) -> dict[str, Any] | None:
    """Run ``config`` as ``gpipe train`` does: checks, the run folder, the stages in local
    processes (or this rank under torchrun), progress, and the summary printed at the end.
    Returns the summary on the rank that reports (this process, unless under torchrun; None
    on the others): ``steps``, ``train_loss`` and ``val_loss`` (nats per ``unit``, ``"byte"``
    or ``"token"``), ``seconds``, ``tokens_per_s``, ``balance`` (layers per stage),
    ``peak_memory_bytes`` (one per process) and ``sample`` (the text generated at the end).

    The processes it starts import the calling script again: call it under
    ``if __name__ == "__main__":`` (a notebook or ``python -c`` needs nothing)."""
    from gpipe.training.run_lock import holding_run_folder

    _refuse_reimport()
    run = resolve(config)
    model, opts, out = run.model, run.options, run.out
    torchrun = under_torchrun()
    _check_data(opts, model, out)
    fresh_weights = model.kind == "hf" and model.weights is None
    if fresh_weights:  # drawn once, in the run folder, where every rank reads its stage's
        model.weights = str(out / "initial")
    record: dict[str, Any] = {
        "model": model.to_dict(),
        "train": asdict(opts),
        "config": config_values(run.config),
    }
    restarted = run.held is not None
    if torchrun:
        from gpipe.training.elastic import job_id

        record["job"] = job_id()  # how a restart of this job knows the folder for its own
    if opts.schedule != "auto" and (not torchrun or os.environ["RANK"] == "0"):
        _advise(opts)

    def prepare() -> None:
        _prepare_folder(out, config.resume is not None or restarted, config.force, record)
        if fresh_weights:
            starting_weights(model, opts.seed)
        _prepare_data(opts, model, out)

    if torchrun:
        restarted = _agree_on_folder(prepare, opts.device, opts.timeout, restarted)
        summary = _run_stages(run, config, restarted)
    else:
        flag = "--resume" if config.resume is not None else "--out"
        with holding_run_folder(out, flag):  # while its processes train, restarts included
            prepare()
            summary = _run_stages(run, config, restarted)
    if summary is not None:
        _print_summary(summary, out)
    return summary


def _run_stages(run: ResolvedRun, config: TrainConfig, restarted: bool) -> dict[str, Any] | None:
    """Run the stages of the prepared run: this rank's under torchrun, else all of them in
    local processes; the summary where this process reports. A failure of the local
    processes ends in a LaunchError that says what the run can continue from."""
    from gpipe.training.checkpoints.resuming import continuing_line
    from gpipe.training.launch import LaunchError, launch, threads_per_process
    from gpipe.training.stage_run import run_stage

    model, opts, out, torchrun = run.model, run.options, run.out, under_torchrun()
    resume = config.resume is not None and not restarted
    spec = RunSpec(
        model=model.to_dict(),
        train=asdict(opts),
        out=str(out),
        resume=resume,
        restarted=restarted,
        checkpoint=_verified_checkpoint(out) if resume and not torchrun else None,
    )
    processes = opts.stages * opts.data_parallel * opts.tensor_parallel
    if not torchrun or os.environ["RANK"] == "0":
        print(f"{counted(processes, 'process', 'es')}: {layout_text(opts)}", flush=True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torchrun else processes
    threads = (config.threads or threads_per_process(local)) if opts.device == "cpu" else None
    if not torchrun:
        try:
            restarts = config.max_restarts or 0
            return launch(run_stage, processes, (spec,), threads=threads, max_restarts=restarts)[0]
        except LaunchError as exc:
            raise LaunchError(f"{exc}\n{continuing_line(out)}", signal=exc.signal) from None
    from gpipe.comm.process_group import finish_process_group
    from gpipe.training.checkpoints.resuming import NothingToResume

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        summary = run_stage(spec)
    except NothingToResume as exc:
        raise ConfigError(f"--resume {out}: {exc}") from None
    finish_process_group()
    return summary


def _refuse_reimport() -> None:
    """Each process ``train`` starts imports the calling script again, as ``__mp_main__``,
    before it runs its stage. A script that calls ``train`` outside an ``if __name__ ==
    "__main__":`` block calls it again there, and would print, check and prepare the run
    folder (with ``force``, remove it) under the running job before failing: refuse first."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise RuntimeError(
                "gpipe.training.train was called again by a process it started, which imports "
                'the calling script: call train under if __name__ == "__main__":'
            )
        frame = frame.f_back


def layout_text(opts: TrainOptions) -> str:
    """How the processes are laid out, for the log: ``2 stages x 1 replica x 2 tensor ranks``."""
    k, d, t = opts.stages, opts.data_parallel, opts.tensor_parallel
    return f"{counted(k, 'stage')} x {counted(d, 'replica')} x {counted(t, 'tensor rank')}"


def shape_from_world(config: TrainConfig, opts: TrainOptions, world: int) -> None:
    """Stages and replicas from the processes torchrun started: ``--stages K`` keeps the
    pipeline's depth and the replicas follow (D = world / K), so a machine admitted or lost
    under ``--nnodes 1:2`` adds or drops replicas; otherwise D stays (``--data-parallel``,
    or what the run had) and the depth follows (K = world / D). The tensor ranks per stage
    (``--tensor-parallel``, or what the run had) always stay: K and D share world / T."""
    for flag, value in (
        ("--stages", config.stages),
        ("--data-parallel", config.data_parallel),
        ("--tensor-parallel", config.tensor_parallel),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    tensor = opts.tensor_parallel
    if world % tensor:
        raise ConfigError(
            f"--tensor-parallel {tensor}, but torchrun started {world} processes, not a multiple"
        )
    started = f"{world} processes"
    if tensor > 1:
        world //= tensor  # the pipelines' ranks: K x D of them
        started += f" ({world} per tensor rank of --tensor-parallel {tensor})"
    if config.stages is not None:
        if world % config.stages:
            raise ConfigError(
                f"--stages {config.stages}, but torchrun started {started}, not a multiple"
            )
        if config.data_parallel is not None and config.data_parallel * config.stages != world:
            raise ConfigError(
                f"--stages {config.stages} x --data-parallel {config.data_parallel} processes, but "
                f"torchrun started {started}: pass one of them, and the other follows"
            )
        opts.stages, opts.data_parallel = config.stages, world // config.stages
        return
    if world % opts.data_parallel:
        raise ConfigError(
            f"--data-parallel {opts.data_parallel}, but torchrun started {started}, not a multiple"
        )
    opts.stages = world // opts.data_parallel


def _advise(opts: TrainOptions) -> None:
    """One line if the run has fewer micro-batches than the GPipe paper's rule of thumb."""
    from gpipe.planning.advice import chunks_advice

    assert opts.chunks is not None  # None only under --schedule auto
    line = chunks_advice(
        opts.schedule,
        opts.stages,
        opts.chunks,
        virtual_stages=opts.virtual_stages,
        checkpoint=opts.checkpoint,
        batch_size=opts.batch_size,
        data_parallel=opts.data_parallel,
    )
    if line is not None:
        print(line, flush=True)


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    memory = ", ".join(f"{b / 2**20:.0f} MiB" for b in summary["peak_memory_bytes"])
    print(
        f"trained {summary['steps']} steps in {summary['seconds']:.1f} s, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, stages {summary['balance']}\n"
        f"loss: train {summary['train_loss']:.3f}, validation {summary['val_loss']:.3f} "
        f"(nats per {summary.get('unit', 'byte')})\n"
        f"peak memory per process: {memory}\n"
        f"run folder: {out}"
    )
    sample = out / "sample.txt"
    if summary["sample"]:
        print(f"sample:\n{summary['sample']}")
        sample.write_text(summary["sample"])
    else:  # --sample-tokens 0: none, and none left from an earlier part of the run
        sample.unlink(missing_ok=True)
