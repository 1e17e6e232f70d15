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

from gpipe.cli.common import UsageError, check_v_stages, multi_stage_schedules
from gpipe.cli.plan_cluster import add_cluster_arguments, is_cluster_plan, plan_cluster
from gpipe.cli.plan_flags import (
    PLAN_DEFAULTS,
    check_model_flags,
    check_tensor_flags,
    check_training_flags,
    training_only_flag,
)
from gpipe.cli.plan_generation import add_generation_arguments, plan_generating
from gpipe.cli.plan_model import (
    add_model_arguments,
    check_split_options,
    model_kind,
    plan_split,
)
from gpipe.cli.plan_shard import add_shard_arguments, plan_options, searched_shards
from gpipe.cli.plan_tables import print_plan, print_suggestions
from gpipe.cli.plan_tensor import (
    add_link_argument,
    one_rank,
    tensor_options,
    with_collectives,
)
from gpipe.cli.seq_chunk_flags import add_seq_chunks_argument, check_plannable, gpt_carry_bytes
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
    LayerCosts,
    Search,
    combine,
    flop_costs,
    search,
    timed_costs,
)
from gpipe.runtime.recompute import CHECKPOINT_MODES
from gpipe.schedules import SCHEDULES

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
        metavar="D",
        help="replicas of the pipeline, --batch-size split among them; adds the all-reduce "
        "buckets to each process (default 1; with --cluster, what T x K leave of the GPUs)",
    )
    add_shard_arguments(p)
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="T",
        help="ranks per stage, its layers split over them as Pipeline(tensor_parallel=T) "
        "splits the GPT's (heads and MLP, vocabulary) or an hf: config's declared plan; "
        "figures are per rank, the world K x D x T (default 1; --suggest tries the divisors "
        "of the heads); with --cluster, GPUs per stage",
    )
    add_link_argument(p)
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
    add_seq_chunks_argument(p, "the built-in GPT profiled on one")
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
    p.add_argument(
        "--top", type=int, help="with --suggest or --search: configurations listed (default 5)"
    )
    add_cluster_arguments(p)
    add_generation_arguments(p)
    p.set_defaults(command=_plan)


def _config(args: argparse.Namespace, n_layer: int) -> Any:
    from gpipe.models.gpt import GPTConfig

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
    """A one-block model on the meta device, and a micro-batch of tokens on ``device`` (of
    one sub-sequence's, with ``--seq-chunks``)."""
    from gpipe.models.gpt import build_gpt

    layers = build_gpt(_config(args, 1), device="meta").to(_DTYPES[args.dtype])
    length = args.seq_len // getattr(args, "seq_chunks", 1)
    tokens = torch.zeros(min(2, args.batch_size), length, dtype=torch.int64, device=device)
    return layers, tokens


def _one_rank_block(args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
    """One rank's share of the one-block model (its heads, with tensor parallelism), and a
    micro-batch of tokens on the meta device."""
    layers, tokens = _one_block(args)
    return one_rank(layers, args.tensor_parallel), tokens


def _template(args: argparse.Namespace) -> Profile:
    """The profile of one rank's share of a one-block model (of all of it, without tensor
    parallelism); deeper models repeat its block (``Profile.repeat``)."""
    from gpipe.models.gpt import lm_loss

    layers, tokens = _one_block(args)
    share = one_rank(layers, args.tensor_parallel)
    return profile(share, tokens, target=tokens, loss_fn=lm_loss)


def _templates(args: argparse.Namespace, tensor_parallel: int) -> tuple[Profile, LayerCosts]:
    """One rank's share of the one-block model: its profile, and its costs per layer: FLOPs
    counted, or (with ``--measure``) forward and backward timed on this machine's CPU, and
    with tensor parallelism the collectives on ``--tp-link``."""
    from gpipe.models.gpt import lm_loss

    layers, tokens = _one_block(args)
    share = one_rank(layers, tensor_parallel)
    prof = profile(share, tokens, target=tokens, loss_fn=lm_loss)
    if args.measure:
        costs = timed_costs(share, torch.zeros_like(tokens, device="cpu"), device="cpu")
    else:
        costs = flop_costs(share, tokens, target=tokens, loss_fn=lm_loss)
    return prof, with_collectives(args, costs, layers, tensor_parallel)


def _plan_for(args: argparse.Namespace, template: Profile, n_layer: int) -> MemoryPlan:
    from gpipe.planning.balancing import partition
    from gpipe.runtime.partitions import even_balance
    from gpipe.training.balance_choice import parse_balance

    prof = template.repeat(1, n_layer)
    parts = args.stages * args.virtual_stages
    if args.balance == "params":
        balance = partition(prof.params, parts)
    else:
        balance = parse_balance(args.balance, parts, len(prof)) or even_balance(len(prof), parts)
    return plan(
        prof,
        balance,
        **plan_options(args),
        seq_chunks=args.seq_chunks,
        carry_bytes=gpt_carry_bytes(args, n_layer, _one_rank_block),
    )


def _smallest(args: argparse.Namespace) -> int:
    """The fewest blocks ``--max-layers`` tries: enough to give every stage a layer."""
    return max(1, args.stages * args.virtual_stages - 2)


def _most_layers(args: argparse.Namespace, template: Profile, memory: int) -> int | None:
    """The most blocks whose plan fits: doubling until one does not, then bisection."""
    smallest = _smallest(args)
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
    if is_cluster_plan(args):
        if args.seq_chunks != 1:
            raise UsageError(f"--seq-chunks {args.seq_chunks} is not planned with --cluster yet")
        return plan_cluster(args)
    if args.data_parallel is None:
        args.data_parallel = 1
    kind = model_kind(args)
    gpt = kind == "gpt"
    check_plannable(args, gpt, str(PLAN_DEFAULTS["schedule"]))
    check_tensor_flags(args, kind)
    if args.generate:
        return _generating(args, kind)
    if args.in_flight is not None:
        raise UsageError("--in-flight needs --generate")
    if args.schedule is not None:  # before the defaults, so that a 1 given is told too
        check_v_stages(args.schedule, args.virtual_stages)
    if not gpt:
        check_split_options(args)
    elif args.suggest:
        return _suggest(args)
    check_training_flags(args, gpt)
    args.tensor_parallel = args.tensor_parallel or 1
    try:
        memory = parse_bytes(args.device_memory)
        if not gpt:
            result, starts = plan_split(args, _DTYPES[args.dtype])
            cut = "cut at --split-at" if args.split_at else "cut by parameters"
            print_plan(args, f"{args.model}: seq_len {args.seq_len}", cut, result, memory, starts)
            return _advise(args, result, memory)
        template = _template(args)
        n_layer = args.n_layer
        if args.max_layers:
            most = _most_layers(args, template, memory)
            if most is None:
                smallest = _smallest(args)
                need = _plan_for(args, template, smallest).peak_bytes
                print(
                    f"not even the smallest model fits in {format_bytes(memory)} per device: "
                    f"{smallest} blocks on {args.stages} stages need {format_bytes(need)} on the "
                    "fullest process (--device-memory at least that)"
                )
                return 1
            n_layer = most
        result = _plan_for(args, template, n_layer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    blocks = "most blocks that fit" if args.max_layers else "blocks"
    heading = f"gpt: {blocks} {n_layer}, d_model {args.d_model}"
    if args.seq_chunks > 1:
        heading += f", micro-batches as {args.seq_chunks} sub-sequences"
    print_plan(args, heading, f"balance {list(result.balance)}", result, memory)
    return _advise(args, result, memory)


def _generating(args: argparse.Namespace, kind: str) -> int:
    """``--generate``: the memory of generating, on the stages given."""
    flag = training_only_flag(args)
    if flag is not None:
        raise UsageError(f"--{flag.replace('_', '-')} plans training; leave out --generate")
    if args.stages is None:  # --stages 0 is refused below, not taken for the default
        cuts = len(args.split_at.split(",")) if args.split_at else None
        args.stages = PLAN_DEFAULTS["stages"] if cuts is None else cuts + 1
    args.balance = args.balance or ("even" if kind == "gpt" else "params")
    args.dtype = args.dtype or "float32"
    check_model_flags(args, "stages")
    try:
        memory = parse_bytes(str(args.device_memory or PLAN_DEFAULTS["device_memory"]))
        return plan_generating(args, kind, _DTYPES[args.dtype], memory)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


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


def _model_params(args: argparse.Namespace) -> int:
    """The whole model's parameters: the one-block model's, its block counted n_layer times."""
    layers, _ = _one_block(args)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return counts[0] + counts[1] * args.n_layer + counts[2]


def _suggest(args: argparse.Namespace) -> int:
    """``--suggest``: the fastest configurations that fit, as a short table."""
    if args.device_memory is None:
        raise UsageError("--suggest needs --device-memory, the memory of one device (e.g. 16GiB)")
    if args.max_layers:
        raise UsageError("--suggest plans the model as given: leave out --max-layers")
    check_model_flags(args, "stages", "chunks", "max_stages", "top")
    shards = searched_shards(args)
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
        args.model_params = _model_params(args)
        ts, bound = tensor_options(args)
        tried: dict[int, Search | str] = {}
        costs_of: dict[int, LayerCosts] = {}
        for t in ts:
            try:
                template, per_layer = _templates(args, t)
            except UsageError as exc:
                if len(ts) == 1:
                    raise
                tried[t] = str(exc).split(": ", 1)[-1]
                continue
            costs_of[t] = per_layer.repeat(1, args.n_layer)
            most = (args.max_stages or MAX_STAGES) // t
            if args.stages is None and most < 1:
                continue
            tried[t] = search(
                template.repeat(1, args.n_layer),
                costs_of[t],
                batch_size=args.batch_size,
                device_bytes=memory,
                optimizer=args.optimizer,
                balance=balance,
                stages=None if args.stages is None else [args.stages],
                chunks=None if args.chunks is None else [args.chunks],
                schedules=None if args.schedule is None else [args.schedule],
                checkpoints=None if args.checkpoint is None else [args.checkpoint],
                virtual_stages=v,
                max_stages=max(1, most),
                data_parallel=args.data_parallel,
                shards=shards,
                tensor_parallel=t,
            )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    found = combine([f for f in tried.values() if isinstance(f, Search)])
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
    best = found.fitting[0].tensor_parallel
    choice = (tried, bound) if len(ts) > 1 or best > 1 else None
    print_suggestions(args, found, costs_of[best], memory, choice)
    return 0
