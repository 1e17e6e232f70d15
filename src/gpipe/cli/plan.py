"""``gpipe plan``: will this model fit on K devices, how many layers would, and which
configuration is fastest among those that fit?

The model is built and profiled on the meta device, so planning a model with billions of
parameters takes neither memory nor compute.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from gpipe.cli.common import UsageError, multi_stage_schedules
from gpipe.cli.plan_model import (
    add_model_arguments,
    check_split_options,
    model_kind,
    plan_split,
)
from gpipe.planning.advice import chunks_advice
from gpipe.planning.memory import (
    OPTIMIZER_STATES,
    MemoryPlan,
    Profile,
    format_bytes,
    plan,
    profile,
)
from gpipe.planning.suggest import (
    MAX_STAGES,
    Candidate,
    LayerCosts,
    Search,
    flop_costs,
    search,
    timed_costs,
)
from gpipe.runtime.recompute import CHECKPOINT_MODES
from gpipe.schedules import SCHEDULES, traits

__all__ = ["add_parser", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_bytes(text: str) -> int:
    """``16GiB``, ``512 MB`` or ``1e9`` to a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"--device-memory must be a size such as 16GiB or 80GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="predict memory per stage; find the most layers that fit",
        description="Predict each process's peak memory (parameters, gradients, optimizer "
        "state and activations) for a model cut into pipeline stages, without allocating "
        "it: the model is profiled on the meta device.",
    )
    add_model_arguments(p)
    p.add_argument("--stages", type=int, metavar="K", help="processes (default 4)")
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="D",
        help="replicas of the pipeline, --batch-size split among them; adds the all-reduce "
        "buckets to each process (default 1)",
    )
    p.add_argument("--chunks", type=int, metavar="M", help="micro-batches (default 8)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--schedule", choices=SCHEDULES, help="default gpipe")
    p.add_argument(
        "--virtual-stages",
        type=int,
        help=f"stages per process with {multi_stage_schedules()} (default 1; 2 with --suggest)",
    )
    p.add_argument(
        "--checkpoint",
        choices=CHECKPOINT_MODES,
        help="re-materialization (default except_last)",
    )
    p.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam", help="default adam"
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="default float32")
    p.add_argument(
        "--balance",
        help="where to cut: even (default), params, or layers per stage such as 3,3; with "
        "--suggest also time (its default: the slowest stage as fast as it can be)",
    )
    p.add_argument("--device-memory", help="memory of one device (default 16GiB)")
    p.add_argument(
        "--max-layers", action="store_true", help="find the most blocks that fit, then plan it"
    )
    p.add_argument(
        "--suggest",
        action="store_true",
        help="search stages, chunks, schedule and checkpoint mode (each pinned if given) and "
        "print the fastest configurations that fit in --device-memory",
    )
    p.add_argument(
        "--max-stages",
        type=int,
        help=f"with --suggest: the most processes searched (default {MAX_STAGES})",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="with --suggest: time one block, the embedding and the head on this machine "
        "instead of counting their FLOPs",
    )
    p.add_argument("--top", type=int, help="with --suggest: configurations listed (default 5)")
    p.set_defaults(command=_plan)


_PLAN_DEFAULTS = {
    "stages": 4,
    "chunks": 8,
    "schedule": "gpipe",
    "virtual_stages": 1,
    "checkpoint": "except_last",
    "balance": "even",
    "device_memory": "16GiB",
}


def _config(args: argparse.Namespace, n_layer: int) -> Any:
    from gpipe.training.models.gpt import GPTConfig

    return GPTConfig(
        n_layer=n_layer,
        d_model=args.d_model,
        n_head=args.n_head,
        d_ff=args.d_ff,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        tied=not args.no_tie_embeddings,
    )


def _one_block(args: argparse.Namespace, device: str = "meta") -> tuple[Any, torch.Tensor]:
    """A one-block model on the meta device, and a micro-batch of tokens on ``device``."""
    from gpipe.training.models.gpt import build_gpt

    layers = build_gpt(_config(args, 1), device="meta").to(_DTYPES[args.dtype])
    tokens = torch.zeros(min(2, args.batch_size), args.seq_len, dtype=torch.int64, device=device)
    return layers, tokens


def _template(args: argparse.Namespace) -> Profile:
    """The profile of a one-block model; deeper models repeat its block (``Profile.repeat``)."""
    from gpipe.training.models.gpt import lm_loss

    layers, tokens = _one_block(args)
    return profile(layers, tokens, target=tokens, loss_fn=lm_loss)


def _templates(args: argparse.Namespace) -> tuple[Profile, LayerCosts]:
    """The one-block model's profile, and its costs per layer: FLOPs counted, or (with
    ``--measure``) forward and backward timed on this machine's CPU."""
    from gpipe.training.models.gpt import lm_loss

    layers, tokens = _one_block(args)
    prof = profile(layers, tokens, target=tokens, loss_fn=lm_loss)
    if args.measure:
        return prof, timed_costs(layers, torch.zeros_like(tokens, device="cpu"), device="cpu")
    return prof, flop_costs(layers, tokens, target=tokens, loss_fn=lm_loss)


def _plan_for(args: argparse.Namespace, template: Profile, n_layer: int) -> MemoryPlan:
    from gpipe.planning.balancing import partition
    from gpipe.runtime.partitions import even_balance
    from gpipe.training.job import parse_balance

    prof = template.repeat(1, n_layer)
    parts = args.stages * args.virtual_stages
    if args.balance == "params":
        balance = partition(prof.params, parts)
    else:
        balance = parse_balance(args.balance, parts, len(prof)) or even_balance(len(prof), parts)
    return plan(
        prof,
        balance,
        batch_size=args.batch_size,
        chunks=args.chunks,
        schedule=args.schedule,
        checkpoint=args.checkpoint,
        optimizer=args.optimizer,
        n_ranks=args.stages,
        data_parallel=args.data_parallel,
    )


def _check_model(args: argparse.Namespace, *more: str) -> None:
    for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "batch_size", *more):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.n_head is not None and args.d_model % args.n_head:
        raise UsageError(f"--d-model {args.d_model} must be a multiple of --n-head {args.n_head}")


def _check(args: argparse.Namespace, gpt: bool) -> None:
    for flag in ("suggest", "max_stages", "measure", "top"):
        if getattr(args, flag) not in (None, False):
            raise UsageError(f"--{flag.replace('_', '-')} needs --suggest")
    for name, value in _PLAN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    _check_model(args, "stages", "chunks", "virtual_stages", "data_parallel")
    if args.batch_size < args.data_parallel:
        raise UsageError(
            f"--batch-size {args.batch_size} cannot give each of --data-parallel "
            f"{args.data_parallel} replicas a row"
        )
    schedule = traits(args.schedule)
    if args.virtual_stages > 1 and not schedule.several_stages_per_rank:
        raise UsageError(f"--virtual-stages needs --schedule {multi_stage_schedules()}")
    if schedule.microbatches_per_round and args.chunks % args.stages:
        raise UsageError(
            f"--schedule {args.schedule} needs --chunks a multiple of --stages {args.stages}"
        )
    if args.balance == "time":
        raise UsageError(
            "--balance time needs a run to time, or --suggest; gpipe plan cuts even, by params "
            "or as given"
        )
    if args.max_layers and args.balance not in ("even", "params"):
        raise UsageError("--max-layers cuts each candidate itself: --balance even or params")
    if not gpt:  # gpipe.split says how many stages the model can be cut into
        return
    layers = args.n_layer + 2
    if not args.max_layers and args.stages * args.virtual_stages > layers:
        raise UsageError(
            f"--stages {args.stages} x --virtual-stages {args.virtual_stages} is more than the "
            f"model's {layers} layers ({args.n_layer} blocks, embedding and head)"
        )


def _most_layers(args: argparse.Namespace, template: Profile, memory: int) -> int | None:
    """The most blocks whose plan fits: doubling until one does not, then bisection."""
    smallest = max(1, args.stages * args.virtual_stages - 2)
    if not _plan_for(args, template, smallest).fits(memory):
        return None
    fits, high = smallest, smallest * 2
    while _plan_for(args, template, high).fits(memory):
        fits, high = high, high * 2
        if high > 1 << 20:
            return fits
    while high - fits > 1:
        mid = (fits + high) // 2
        if _plan_for(args, template, mid).fits(memory):
            fits = mid
        else:
            high = mid
    return fits


def _plan(args: argparse.Namespace) -> int:
    gpt = model_kind(args) == "gpt"
    if not gpt:
        check_split_options(args)
    elif args.suggest:
        return _suggest(args)
    _check(args, gpt)
    try:
        memory = parse_bytes(args.device_memory)
        if not gpt:
            result, starts = plan_split(args, _DTYPES[args.dtype])
            cut = "cut at --split-at" if args.split_at else "cut by parameters"
            _print(args, f"{args.model}: seq_len {args.seq_len}", cut, result, memory, starts)
            return _advise(args, result, memory)
        template = _template(args)
        n_layer = args.n_layer
        if args.max_layers:
            most = _most_layers(args, template, memory)
            if most is None:
                print(f"not even the smallest model fits in {format_bytes(memory)} per device")
                return 1
            n_layer = most
        result = _plan_for(args, template, n_layer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    blocks = "most blocks that fit" if args.max_layers else "blocks"
    heading = f"gpt: {blocks} {n_layer}, d_model {args.d_model}"
    _print(args, heading, f"balance {list(result.balance)}", result, memory)
    return _advise(args, result, memory)


def _advise(args: argparse.Namespace, result: MemoryPlan, memory: int) -> int:
    """Print the micro-batch advice, if any; the exit code: 0 if the plan fits, else 1."""
    advice = chunks_advice(
        args.schedule,
        args.stages,
        args.chunks,
        virtual_stages=args.virtual_stages,
        checkpoint=args.checkpoint,
        batch_size=args.batch_size,
        data_parallel=args.data_parallel,
    )
    if advice is not None:
        print(advice)
    return 0 if result.fits(memory) else 1


def _rows(args: argparse.Namespace) -> str:
    """The sequences a process's mini-batch holds: the batch, or each replica's share."""
    if args.data_parallel == 1:
        return str(args.batch_size)
    share = -(-args.batch_size // args.data_parallel)
    return f"{share} (of {args.batch_size}, over {args.data_parallel} replicas)"


def _print(
    args: argparse.Namespace,
    heading: str,
    cut: str,
    result: MemoryPlan,
    memory: int,
    starts: list[str] | None = None,
) -> None:
    """The plan's table, a row per process; ``starts`` (a split model's): the submodule
    where each stage begins, in place of the count of layers."""
    params = sum(r.params for r in result.ranks)
    print(
        f"{heading}, {params / 1e6:,.1f} M parameters "
        f"({args.dtype}); {args.stages} stages, {cut}, "
        f"{args.schedule}, {args.chunks} micro-batches of {_rows(args)} sequences, "
        f"checkpoint {args.checkpoint}, {args.optimizer}"
    )
    replicated = args.data_parallel > 1
    header = ["rank", "layers" if starts is None else "stages begin at", "parameters",
              "weights", "grads+optimizer", "activations",
              *(["all-reduce"] if replicated else []), "total",
              f"fits {format_bytes(memory)}"]  # fmt: skip
    rows = [
        [
            str(r.rank),
            str(r.layers) if starts is None else ", ".join(starts[s] for s in r.stages),
            f"{r.params / 1e6:,.1f} M",
            format_bytes(r.param_bytes),
            format_bytes(r.state_bytes),
            format_bytes(r.activation_bytes),
            *([format_bytes(r.allreduce_bytes)] if replicated else []),
            format_bytes(r.total_bytes),
            "yes" if r.total_bytes <= memory else "no",
        ]
        for r in result.ranks
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def _suggest(args: argparse.Namespace) -> int:
    """``--suggest``: the fastest configurations that fit, as a short table."""
    if args.device_memory is None:
        raise UsageError("--suggest needs --device-memory, the memory of one device (e.g. 16GiB)")
    if args.max_layers:
        raise UsageError("--suggest plans the model as given: leave out --max-layers")
    _check_model(args, "stages", "chunks", "max_stages", "top")
    if args.chunks is not None and args.chunks > args.batch_size:
        raise UsageError(
            f"--chunks {args.chunks} is more than --batch-size {args.batch_size}: a "
            "micro-batch needs at least one sequence"
        )
    balance = args.balance or "time"
    if balance not in ("time", "even", "params"):
        raise UsageError(
            f"--suggest cuts every configuration itself: --balance time, even or params, "
            f"got {balance!r}"
        )
    v = 2 if args.virtual_stages is None else args.virtual_stages
    if v < 2:
        raise UsageError(
            f"--virtual-stages with --suggest is the {multi_stage_schedules()} schedule's "
            f"stages per process: at least 2, got {v}"
        )
    try:
        memory = parse_bytes(args.device_memory)
        template, per_layer = _templates(args)
        costs = per_layer.repeat(1, args.n_layer)
        found = search(
            template.repeat(1, args.n_layer),
            costs,
            batch_size=args.batch_size,
            device_bytes=memory,
            optimizer=args.optimizer,
            balance=balance,
            stages=None if args.stages is None else [args.stages],
            chunks=None if args.chunks is None else [args.chunks],
            schedules=None if args.schedule is None else [args.schedule],
            checkpoints=None if args.checkpoint is None else [args.checkpoint],
            virtual_stages=v,
            max_stages=args.max_stages or MAX_STAGES,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if found.least is None:
        raise UsageError(
            "no configuration to search: --stages, --chunks, --schedule and --virtual-stages "
            f"leave none for a model of {args.n_layer + 2} layers and --batch-size "
            f"{args.batch_size}"
        )
    if not found.fitting:
        least = found.least
        print(
            f"nothing fits in {format_bytes(memory)} per process: of {found.searched} "
            f"configurations searched, the least memory is {format_bytes(least.peak_bytes)} "
            f"({least.options()})"
        )
        return 1
    _print_suggestions(args, found, costs, memory)
    return 0


def _print_suggestions(
    args: argparse.Namespace, found: Search, costs: LayerCosts, memory: int
) -> None:
    shown = found.fitting[: args.top or 5]
    params = sum(r.params for r in shown[0].memory.ranks)
    print(
        f"gpt: blocks {args.n_layer}, d_model {args.d_model}, {params / 1e6:,.1f} M parameters "
        f"({args.dtype}); {args.batch_size} sequences per step, {args.optimizer}, "
        f"{format_bytes(memory)} per process"
    )
    print(f"{found.fits} of {found.searched} configurations fit ({_bounds(found)})")
    print(f"time: {costs.source}, backward 2 x forward, messages free")
    timed = costs.unit == "s"
    best = shown[0].step_time
    time = "step time" if timed else "relative time"
    header = ["stages", "chunks", "schedule", "checkpoint", time, "bubble", "peak memory", "fits"]
    rows = [_row(c, best, timed, memory) for c in shown]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    left = {2, 3}  # names read better aligned left
    for row in [header, *rows]:
        cells = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]  # fmt: skip
        print("  ".join(cells).rstrip())
    print(f"fastest: {shown[0].options()}")


def _row(c: Candidate, best: float, timed: bool, memory: int) -> list[str]:
    schedule = c.schedule if c.virtual_stages == 1 else f"{c.schedule} v={c.virtual_stages}"
    return [
        str(c.stages),
        str(c.chunks),
        schedule,
        c.checkpoint,
        f"{c.step_time:.3g} s" if timed else f"{c.step_time / best:.2f}",
        f"{c.bubble:.1%}",
        format_bytes(c.peak_bytes),
        f"yes ({c.peak_bytes / memory:.0%})",
    ]


def _bounds(found: Search) -> str:
    """What was searched, in a few words: the range of each dimension."""

    def span(values: set[Any]) -> str:
        low, high = min(values), max(values)
        return str(low) if low == high else f"{low}-{high}"

    grid = found.grid
    return (
        f"stages {span({g[0] for g in grid})}, chunks {span({g[1] for g in grid})}, "
        f"{len({g[2] for g in grid})} schedules, {len({g[3] for g in grid})} checkpoint modes"
    )
