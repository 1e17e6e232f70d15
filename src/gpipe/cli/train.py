"""``gpipe train``: a GPT language model trained in pipeline stages, one process each, from a
run folder it can resume, by hand or by itself after torchrun's agent restarts it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from gpipe.cli.common import UsageError, multi_stage_schedules, positive
from gpipe.cli.config_file import apply_config_file, config_text, resolved_config
from gpipe.cli.train_flags import (
    add_model_options,
    add_pipeline_options,
    add_run_folder_options,
    add_training_options,
)
from gpipe.cli.train_model import (
    check_pack,
    model_layer_count,
    resolve_model,
    starting_weights,
)
from gpipe.runtime.recompute import check_checkpoint
from gpipe.schedules import traits

__all__ = ["add_parser"]

RUN_FILE = "run.json"  # the run's model config and options, written when it starts


def _under_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a GPT language model, pipelined over several processes",
        description="Train a GPT-style byte-level language model split into pipeline stages. "
        "With no arguments: the 'small' preset on the Python standard library's sources, "
        "2 stages in 2 local processes, GPipe schedule, 8 micro-batches.",
    )
    add_model_options(p.add_argument_group("model"))
    add_pipeline_options(p.add_argument_group("pipeline"))
    add_training_options(p.add_argument_group("training"))
    add_run_folder_options(p.add_argument_group("run folder"))
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="flags as keys of a TOML file (batch-size = 16); flags given here win",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration, as a file --config reads, and stop",
    )
    p.set_defaults(command=_train, train_parser=p)


def _train_options(args: argparse.Namespace, saved: dict[str, Any] | None) -> Any:
    from gpipe.training.job import TrainOptions

    values = dict(saved or {})
    if saved is not None and args.pack and not saved.get("pack", False):
        raise UsageError(
            "--pack: the run being continued trained on windows of the token stream; a run "
            "packs documents from its start or never (start a new run with --pack)"
        )
    for f in fields(TrainOptions):
        given = getattr(args, f.name, None)
        if given is not None and given is not False:
            values[f.name] = given
    for flag in ("quiet", "trace", "sync_save"):
        if getattr(args, flag):
            values[flag] = True
    for path in ("data", "val_data", "tokenizer"):  # the run is read from other folders too
        if getattr(args, path) is not None:
            values[path] = str(Path(getattr(args, path)).resolve())
    if values.get("schedule") == "auto" and args.chunks is None and saved is None:
        values["chunks"] = None  # the search chooses it
    return TrainOptions(**values)


def _check(model: Any, opts: Any) -> None:
    for name in (
        "stages",
        "data_parallel",
        "chunks",
        "steps",
        "batch_size",
        "seq_len",
        "eval_every",
        "virtual_stages",
    ):
        positive(name.replace("_", "-"), getattr(opts, name))
    if opts.warmup < 0 or opts.save_every < 0 or opts.keep_every < 0:
        raise UsageError("--warmup, --save-every and --keep-every must not be negative")
    if opts.sync_save and opts.save_writer != "auto":
        raise UsageError(
            f"--save-writer {opts.save_writer} (given, or the run's own) says what writes in "
            "the background, but --sync-save writes with training stopped: give one of them"
        )
    if opts.keep < 1:
        raise UsageError(f"--keep must be at least 1 (the newest good checkpoint), got {opts.keep}")
    layers = model_layer_count(model)
    if opts.batch_size < opts.data_parallel:
        raise UsageError(
            f"--batch-size {opts.batch_size} cannot give each of --data-parallel "
            f"{opts.data_parallel} replicas a row"
        )
    if layers is not None and opts.stages > layers:
        raise UsageError(
            f"--stages {opts.stages} is more than the model's {layers} layers "
            f"({layers - 2} blocks, embedding and head); at most {layers} stages"
        )
    if opts.seq_len is not None and opts.seq_len > model.seq_len:
        more = "raise --context" if model.kind == "gpt" else "its config says so"
        raise UsageError(
            f"--seq-len {opts.seq_len} is above the model's maximum of {model.seq_len} ({more})"
        )
    _check_shard(opts)
    if model.kind == "hf" and opts.balance not in ("time", "params"):
        raise UsageError(
            f"--balance {opts.balance}: a Hugging Face model is cut by tracing, by parameters "
            "(time and params both mean that on the meta device) or at --split-at NAME,..."
        )
    if opts.schedule == "auto":
        _check_auto(opts, model)
    else:
        _check_schedule(opts, layers)
    try:
        check_checkpoint(opts.checkpoint)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but this machine has no CUDA device")


def _check_shard(opts: Any) -> None:
    """``--shard``: only ``full`` exists, and only with replicas to shard over."""
    if opts.shard == "none":
        return
    from torch import nn

    from gpipe.parallel.sharding import check_shard

    try:
        check_shard(opts.shard, opts.data_parallel, nn.Sequential())
    except ValueError as exc:
        raise UsageError(
            f"--shard {opts.shard} (with --data-parallel {opts.data_parallel}): {exc}"
        ) from None


def _check_auto(opts: Any, model: Any) -> None:
    """``--schedule auto`` chooses the stages per process and the cut itself."""
    if model.kind == "hf" or model.split_at:
        raise UsageError(
            f"--schedule auto cuts an nn.Sequential between its layers; --model {model.source} "
            "is split by tracing: pass --schedule and --chunks"
        )
    if opts.virtual_stages > 1:
        raise UsageError(
            f"--virtual-stages {opts.virtual_stages}: --schedule auto chooses the stages per "
            "process; leave it out"
        )
    if opts.balance != "time":
        raise UsageError(
            f"--balance {opts.balance}: --schedule auto chooses the cut by time; leave it out"
        )
    share = opts.batch_size // opts.data_parallel
    if opts.chunks is not None and opts.chunks > share:
        raise UsageError(
            f"--chunks {opts.chunks} is more than each replica's {share} rows of --batch-size"
        )


def _check_schedule(opts: Any, layers: int | None) -> None:
    """A named schedule: its stages per process and micro-batch rules, and the cut."""
    from gpipe.training.job import parse_balance

    try:
        schedule = traits(opts.schedule)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if opts.virtual_stages > 1 and not schedule.several_stages_per_rank:
        raise UsageError(
            f"--virtual-stages {opts.virtual_stages} needs --schedule {multi_stage_schedules()}, "
            f"not {opts.schedule}"
        )
    if schedule.microbatches_per_round and (
        opts.chunks % opts.stages or opts.batch_size // opts.data_parallel < opts.chunks
    ):
        raise UsageError(
            f"--schedule {opts.schedule} needs --chunks a multiple of --stages ({opts.stages}) and "
            f"each replica's share of --batch-size at least --chunks, got --chunks "
            f"{opts.chunks} and --batch-size {opts.batch_size} over {opts.data_parallel} "
            "replica(s)"
        )
    if not schedule.runs(opts.stages, opts.chunks, opts.virtual_stages):
        fewest = schedule.fewest_microbatches(opts.stages, opts.virtual_stages)
        raise UsageError(
            f"--schedule {opts.schedule} needs --chunks of at least {fewest} for --stages "
            f"{opts.stages}, got {opts.chunks}"
        )
    if layers is not None and opts.parts > layers:
        raise UsageError(
            f"--stages {opts.stages} x --virtual-stages {opts.virtual_stages} is more than the "
            f"model's {layers} layers ({layers - 2} blocks, embedding and head)"
        )
    if layers is None:
        return  # a split model: the ranks cut it where --split-at or the balance says
    try:
        parse_balance(opts.balance, opts.parts, layers)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_data(opts: Any, model: Any, out: Path) -> None:
    """The data against the model, before any process starts: the tokenizer's vocabulary,
    the token ids, one window of each part. Text a tokenizer must turn into ids is checked
    once it is, in the run folder."""
    from gpipe.training.run_data import checked_documents, data_prepared, run_dataset
    from gpipe.training.tokenizer import check_tokenizer, load_tokenizer
    from gpipe.training.tokens import check_vocabulary, check_windows

    try:
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
        raise UsageError(str(exc)) from None


def _prepare_data(opts: Any, model: Any, out: Path) -> None:
    """Tokenize text data once into the run folder, then check it as any data is."""
    from gpipe.training.run_data import prepare_run_data

    try:
        prepare_run_data(opts, out)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    _check_data(opts, model, out)


def _prepare_folder(out: Path, resume: bool, force: bool, run: dict[str, Any]) -> None:
    """Refuse to overwrite a run unless told to; record what this run is."""
    if not resume and out.exists() and any(out.iterdir()):
        if not force:
            raise UsageError(
                f"run folder {out} is not empty; pass --force to replace it, "
                f"or --resume {out} to continue it"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    temporary = out / f".{RUN_FILE}.tmp"  # renamed: a restarted process never reads half of it
    temporary.write_text(json.dumps(run, indent=2) + "\n")
    os.replace(temporary, out / RUN_FILE)


def _saved_run(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.resume is None:
        return None
    from gpipe.training.checkpoints import checkpoint_dirs, verify_checkpoint

    folder = Path(args.resume)
    # Sizes only here; the processes check every file's SHA-256 before they load one.
    whole = any(
        not verify_checkpoint(p, checksums=False) for p in checkpoint_dirs(folder / "checkpoints")
    )
    if not (folder / RUN_FILE).is_file() or not whole:
        raise UsageError(f"--resume {folder}: no gpipe run with a complete checkpoint there")
    return _run_record(folder / RUN_FILE)


def _verified_checkpoint(out: Path) -> str:
    """The newest checkpoint of the run being resumed that verifies whole and safe to open,
    found before any process starts (each newer one is warned of and skipped), so that a run
    with none ends in one line naming each checkpoint and why."""
    from gpipe.training.checkpoints import (
        DamagedCheckpointWarning,
        checkpoint_dirs,
        verify_checkpoint,
    )

    refused = []
    for path in reversed(checkpoint_dirs(out / "checkpoints")):
        problems = verify_checkpoint(path)
        if not problems:
            for name, why in refused:
                skipped = out / "checkpoints" / name
                warning = f"checkpoint {skipped} is damaged ({why}); skipped for an older one"
                warnings.warn(warning, DamagedCheckpointWarning, stacklevel=1)
            return path.name
        refused.append((path.name, "; ".join(problems)))
    listed = "; ".join(f"{name}: {why}" for name, why in refused)
    raise UsageError(f"--resume {out}: no checkpoint there can be opened ({listed})")


def _run_record(path: Path) -> dict[str, Any]:
    """The run recorded in ``path``, checked field by field (a run folder may come from
    anyone); one line if it is not a record gpipe wrote."""
    from gpipe.training.run_record import checked_run_record

    try:
        return checked_run_record(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _this_jobs_run(out: Path) -> dict[str, Any] | None:
    """The run in ``out`` if this torchrun job started it: the job is being restarted (after
    a lost process, or to admit or drop a machine) and continues it."""
    from gpipe.training.elastic import job_id

    if not (out / RUN_FILE).is_file():
        return None
    run = _run_record(out / RUN_FILE)
    job = job_id()
    return run if job is not None and run.get("job") == job else None


def _agree_on_folder(prepare: Any, device: str, timeout: float, restarted: bool) -> bool:
    """Under torchrun, rank 0 prepares the run folder and every rank learns the outcome, and
    whether rank 0 found the job restarted (a rank that read the folder after rank 0 had
    written it could think so wrongly); returns that."""
    import torch.distributed as dist

    from gpipe.training.elastic import join_process_group

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    join_process_group(
        torch.device("cuda", local_rank) if device == "cuda" else torch.device(device), timeout
    )
    message: list[Any] = [None, restarted]
    if dist.get_rank() == 0:
        try:
            prepare()
        except UsageError as exc:
            message[0] = str(exc)
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise UsageError(message[0])
    return bool(message[1])


def _train(args: argparse.Namespace) -> int:
    from gpipe.training.job import RunSpec, run_stage
    from gpipe.training.launch import launch, threads_per_process

    apply_config_file(args, args.train_parser)
    torchrun = _under_torchrun()
    if torchrun and args.max_restarts is not None:
        raise UsageError(
            f"--max-restarts {args.max_restarts}: under torchrun, restarts are torchrun's; "
            "pass torchrun --max-restarts instead"
        )
    if args.max_restarts is not None and args.max_restarts < 0:
        raise UsageError(f"--max-restarts must not be negative, got {args.max_restarts}")
    out = Path(args.resume or args.out)
    held = _this_jobs_run(out) if torchrun else None
    saved = held or _saved_run(args)
    model = resolve_model(args, saved and saved["model"], out)
    opts = _train_options(args, saved and saved["train"])
    if torchrun:
        _shape_from_world(args, opts, int(os.environ["WORLD_SIZE"]))
    _check(model, opts)
    check_pack(opts, model)
    config = resolved_config(args, args.train_parser, model, opts)
    if args.print_config:
        print(config_text(config), end="")
        return 0
    _check_data(opts, model, out)
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be a positive integer, got {args.threads}")
    fresh_weights = model.kind == "hf" and model.weights is None
    if fresh_weights:  # drawn once, in the run folder, where every rank reads its stage's
        model.weights = str(out / "initial")
    run: dict[str, Any] = {"model": model.to_dict(), "train": asdict(opts), "config": config}
    restarted = held is not None
    if torchrun:
        from gpipe.training.elastic import job_id

        run["job"] = job_id()  # how a restart of this job knows the folder for its own
    if opts.schedule != "auto" and (not torchrun or os.environ["RANK"] == "0"):
        _advise(opts)

    def prepare() -> None:
        _prepare_folder(out, args.resume is not None or restarted, args.force, run)
        if fresh_weights:
            starting_weights(model, opts.seed)
        _prepare_data(opts, model, out)

    if torchrun:
        restarted = _agree_on_folder(prepare, opts.device, opts.timeout, restarted)
    else:
        prepare()
    resume = args.resume is not None and not restarted
    spec = RunSpec(
        model=model.to_dict(),
        train=asdict(opts),
        out=str(out),
        resume=resume,
        restarted=restarted,
        checkpoint=_verified_checkpoint(out) if resume and not torchrun else None,
    )
    processes = opts.stages * opts.data_parallel
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torchrun else processes
    threads = (args.threads or threads_per_process(local)) if opts.device == "cpu" else None
    if torchrun:
        from gpipe.pipeline import finish_process_group

        if threads is not None:
            torch.set_num_threads(threads)
        from gpipe.training.resuming import NothingToResume

        try:
            summary = run_stage(spec)
        except NothingToResume as exc:
            raise UsageError(f"--resume {out}: {exc}") from None
        finish_process_group()
    else:
        restarts = args.max_restarts or 0
        # spawn: the agent then sees a killed process die at once, and names it as the
        # failure; through a forkserver its exit is relayed and a peer that stopped on losing
        # it may be reported first
        summary = launch(
            run_stage, processes, (spec,), threads=threads, max_restarts=restarts,
            start_method="spawn",
        )[0]  # fmt: skip
    if summary is not None:
        _print_summary(summary, out)
    return 0


def _shape_from_world(args: argparse.Namespace, opts: Any, world: int) -> None:
    """Stages and replicas from the processes torchrun started: ``--stages K`` keeps the
    pipeline's depth and the replicas follow (D = world / K), so a machine admitted or lost
    under ``--nnodes 1:2`` adds or drops replicas; otherwise D stays (``--data-parallel``,
    or what the run had) and the depth follows (K = world / D)."""
    for flag, value in (("--stages", args.stages), ("--data-parallel", args.data_parallel)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    if args.stages is not None:
        if world % args.stages:
            raise UsageError(
                f"--stages {args.stages}, but torchrun started {world} processes, not a multiple"
            )
        if args.data_parallel is not None and args.data_parallel * args.stages != world:
            raise UsageError(
                f"--stages {args.stages} x --data-parallel {args.data_parallel} processes, but "
                f"torchrun started {world}: pass one of them, and the other follows"
            )
        opts.stages, opts.data_parallel = args.stages, world // args.stages
        return
    if world % opts.data_parallel:
        raise UsageError(
            f"--data-parallel {opts.data_parallel}, but torchrun started {world} processes, "
            "not a multiple"
        )
    opts.stages = world // opts.data_parallel


def _advise(opts: Any) -> None:
    """One line if the run has fewer micro-batches than the GPipe paper's rule of thumb."""
    from gpipe.planning.advice import chunks_advice

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
        f"run folder: {out}\n"
        f"sample:\n{summary['sample']}"
    )
    (out / "sample.txt").write_text(summary["sample"])
