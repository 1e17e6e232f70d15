"""``gpipe plan --cluster NxDEVICE``: a model's step on a cluster of GPUs, predicted before
the cluster is rented: step time, teraFLOP/s per GPU, MFU and memory per GPU, for one
layout, or (``--search``) the fastest layouts that fit.

The model is the built-in GPT (Megatron-LM's, shaped by ``--n-layer`` and the like) or a
Hugging Face ``config.json`` (``--model hf:PATH``), read for its shapes only; nothing is
built. The cost model is ``gpipe.planning.cluster`` (docs/planning.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from gpipe.cli.common import UsageError
from gpipe.cli.plan_cluster_output import print_json, print_prediction, print_search
from gpipe.planning.cluster import Prediction, predict
from gpipe.planning.cluster_layout import Layout, check_virtual_stages
from gpipe.planning.cluster_memory import BYTES_PER_PARAM
from gpipe.planning.cluster_search import SearchSpace, search
from gpipe.planning.hardware import Cluster, Device, load_devices, parse_cluster
from gpipe.planning.hf_config import from_hf_config
from gpipe.planning.layer_costs import RECOMPUTE, STACKS
from gpipe.planning.transformer import TransformerShape, gpt_shape
from gpipe.schedules import Placement, traits

__all__ = ["add_cluster_arguments", "is_cluster_plan", "plan_cluster"]

Choices = dict[str, list[int]]  # a setting the planner chose, and the values it tried

# gpipe plan's flags that a cluster plan does not read, and what it reads instead
_NOT_WITH_CLUSTER = {
    "chunks": "--global-batch and --micro-batch give the micro-batches",
    "checkpoint": "use --recompute none|selective|full",
    "device_memory": "the device's memory is the catalogue's",
    "suggest": "use --search",
    "max_layers": "plan the model as given",
    "balance": "the blocks are spread evenly over the stages",
    "measure": "costs come from the device's figures",
    "max_stages": "pin --stages, or let --search try every count",
    "split_at": "the blocks are spread evenly over the stages",
    "tokenizer": "the vocabulary is the model's",
    "reshard_after_forward": "sharded parameters are gathered once a step",
    "tp_link": "the link is the cluster device's",
}
_CLUSTER_ONLY = (
    "devices",
    "global_batch",
    "micro_batch",
    "recompute",
    "precision",
    "stack",
    "search",
    "json",
    "dropout",
)


def add_cluster_arguments(p: Any) -> None:
    """The flags of a cluster plan, in their own group of ``gpipe plan --help``."""
    g = p.add_argument_group(
        "cluster plans",
        "--cluster NxDEVICE predicts a step on N GPUs (docs/planning.md); with it, --stages "
        "is K, the pipeline's processes (default 1), --data-parallel D follows from N / (T x "
        "K), and --schedule, --virtual-stages, --seq-len and --shard keep their meaning",
    )
    g.add_argument("--cluster", metavar="NxDEVICE", help="e.g. 3072xA100-80GB")
    g.add_argument(
        "--devices", metavar="FILE", help="a TOML file of more devices ([devices.NAME] tables)"
    )
    g.add_argument("--global-batch", type=int, metavar="B", help="sequences per step")
    g.add_argument(
        "--micro-batch",
        type=int,
        metavar="b",
        help="sequences per micro-batch (default: the fastest that fits of 1, 2, 4, 8)",
    )
    g.add_argument("--recompute", choices=RECOMPUTE, help="re-materialization (default none)")
    g.add_argument(
        "--precision", choices=sorted(BYTES_PER_PARAM), help="default bf16 (mixed, Adam)"
    )
    g.add_argument(
        "--stack",
        choices=sorted(STACKS),
        help="the software the step runs on: megatron-2021 (unfused attention, no sequence "
        "parallelism, blocking sends) or megatron-core (FlashAttention, sequence parallelism, "
        "overlapped collectives); default: the device's (A100s megatron-2021)",
    )
    g.add_argument(
        "--dropout", type=float, help="GPT: dropout probability (default 0.1, Megatron-LM's)"
    )
    g.add_argument(
        "--search",
        action="store_true",
        help="try D x T x K x schedule x micro-batch x recompute x shard (each pinned if "
        "given) and print the fastest layouts that fit, and why the others do not",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object")


def is_cluster_plan(args: argparse.Namespace) -> bool:
    """Whether the command is a cluster plan; its flags and gpipe plan's others are checked
    not to be mixed."""
    if args.cluster is None:
        given = [
            f"--{n.replace('_', '-')}"
            for n in _CLUSTER_ONLY
            if getattr(args, n) not in (None, False)
        ]
        if given:
            raise UsageError(f"{', '.join(given)}: needs --cluster NxDEVICE")
        return False
    for name, instead in _NOT_WITH_CLUSTER.items():
        if getattr(args, name) not in (None, False):
            raise UsageError(f"--{name.replace('_', '-')} is not read with --cluster: {instead}")
    if args.batch_size != 32:
        raise UsageError("--batch-size is not read with --cluster: give --global-batch")
    if args.dtype != "float32":
        raise UsageError("--dtype is not read with --cluster: use --precision")
    return True


def _cluster(args: argparse.Namespace) -> Cluster:
    extra: dict[str, Device] = {}
    try:
        if args.devices is not None:
            extra = load_devices(args.devices)
        return parse_cluster(args.cluster, extra)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _shape(args: argparse.Namespace) -> TransformerShape:
    """The model's shapes: the GPT's flags, or a Hugging Face config read as JSON."""
    from gpipe.cli.plan_model import GPT_DEFAULTS
    from gpipe.training.models.sources import parse_model

    try:
        kind, target = parse_model(args.model)
        if kind == "hf":
            gpt = ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "dropout")
            given = [f for f in gpt if getattr(args, f) is not None]
            if args.no_tie_embeddings:  # a switch: False when not given
                given.append("no_tie_embeddings")
            if given:
                raise ValueError(
                    f"--{given[0].replace('_', '-')} is the GPT's; --model {args.model} gives "
                    "its shape in its config"
                )
            shape = from_hf_config(target)
            if args.seq_len is None:
                args.seq_len = shape.max_seq_len
            if args.seq_len is None:
                raise ValueError(
                    f"--model {args.model}: its config gives no length; pass --seq-len"
                )
            if shape.max_seq_len is not None and args.seq_len > shape.max_seq_len:
                # planned all the same (a longer context is what one plans before extending
                # it), but gpipe train refuses it for this config
                print(
                    f"note: --seq-len {args.seq_len} is above the model's longest sequence of "
                    f"{shape.max_seq_len} (the max_position_embeddings or n_positions of "
                    f"--model {args.model}): gpipe train runs at most {shape.max_seq_len}",
                    file=sys.stderr,
                )
            return shape
        if kind != "gpt":
            raise ValueError(
                f"--cluster plans the GPT or a Hugging Face config (--model hf:config.json), "
                f"got --model {args.model}"
            )
        for name, default in GPT_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        for name in (*GPT_DEFAULTS, "d_ff"):
            value = getattr(args, name)
            if value is not None and value < 1:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be a positive integer, got {value}")
        if args.seq_len is None:
            args.seq_len = 1024
        dropout = 0.1 if args.dropout is None else args.dropout
        shape = gpt_shape(
            args.n_layer,
            args.d_model,
            args.n_head,
            args.vocab_size,
            args.d_ff,
            tied=not args.no_tie_embeddings,
        )
        return dataclasses.replace(shape, dropout=dropout > 0)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_sizes(args: argparse.Namespace) -> None:
    if args.global_batch is None:
        raise UsageError("--cluster needs --global-batch, the sequences in a step")
    sizes = ("global_batch", "micro_batch", "tensor_parallel", "stages", "data_parallel", "top")
    for flag in (*sizes, "seq_len", "virtual_stages"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.top is not None and not args.search:
        raise UsageError("--top lists the layouts of --search: add --search, or leave --top out")
    if args.virtual_stages is not None and args.schedule is not None:
        try:
            check_virtual_stages(args.schedule, args.virtual_stages)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be a probability in [0, 1), got {args.dropout}")


def plan_cluster(args: argparse.Namespace) -> int:
    """``gpipe plan --cluster``: exit code 0 when the plan (or some searched layout) fits,
    1 when nothing does."""
    _check_sizes(args)
    cluster, shape = _cluster(args), _shape(args)
    if args.search:
        return _search(args, shape, cluster)
    prediction, choices, least = _predict(args, shape, cluster)
    if args.json:
        print_json(prediction, shape, choices)
    else:
        print_prediction(prediction, shape, choices)
    if not prediction.fits():
        print(_does_not_fit(prediction, least), file=sys.stderr)
        return 1
    return 0


def _does_not_fit(p: Prediction, least: Prediction) -> str:
    """One line: what the layout needs per GPU, by part, and where the planner chose among
    settings, the least that any choice needs."""
    device, parts = p.layout.cluster.device, p.memory.gib()
    listed = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if k != "total")
    nearest = (
        ""
        if least is p
        else f"; the least of the choices tried, {least.layout.describe()}, needs "
        f"{least.memory_per_gpu_gib:.1f}"
    )
    return (
        f"gpipe: does not fit: {p.layout.describe()} needs {parts['total']:.1f} GiB per GPU "
        f"({listed}){nearest}; the {device.name} has {device.memory_gib:g} GiB"
    )


def _layout(args: argparse.Namespace, cluster: Cluster, v: int, micro_batch: int) -> Layout:
    t, k = args.tensor_parallel or 1, args.stages or 1
    if cluster.gpus % (t * k):
        raise UsageError(
            f"the layout does not cover the cluster: --tensor-parallel {t} x --stages {k} = "
            f"{t * k} GPUs does not divide the cluster's {cluster.gpus}"
        )
    d = cluster.gpus // (t * k)
    if args.data_parallel not in (None, d):
        raise UsageError(
            f"the layout does not cover the cluster: --data-parallel {args.data_parallel} x "
            f"--tensor-parallel {t} x --stages {k} = {args.data_parallel * t * k} GPUs, but "
            f"the cluster has {cluster.gpus}"
        )
    shard = None if args.shard in (None, "none") else args.shard
    return Layout(
        cluster,
        d,
        t,
        k,
        args.global_batch,
        micro_batch,
        args.seq_len,
        args.schedule or "1f1b",
        v,
        args.recompute or "none",
        shard,
        args.precision or "bf16",
        args.stack,
    )


def _virtual_choices(args: argparse.Namespace, shape: TransformerShape) -> list[int]:
    """The stages per process to try: the one given, or (a looped schedule's) those that
    divide a process's blocks; one stage per process otherwise, and a V's two."""
    placement = traits(args.schedule or "1f1b").placement
    k = args.stages or 1
    if args.virtual_stages is not None or placement is not Placement.LOOPED or k == 1:
        return [args.virtual_stages or 1]
    per = shape.layers // k
    found = [v for v in range(2, per + 1) if per % v == 0] if shape.layers % k == 0 else []
    return found or [2]


def _micro_batch_choices(args: argparse.Namespace, cluster: Cluster) -> list[int]:
    """The micro-batches to try: the one given, or those of 1, 2, 4, 8 that divide each
    replica's share of the batch (1 if none does, for its error)."""
    if args.micro_batch is not None:
        return [args.micro_batch]
    replicas = max(1, cluster.gpus // ((args.tensor_parallel or 1) * (args.stages or 1)))
    found = [b for b in (1, 2, 4, 8) if args.global_batch % (replicas * b) == 0]
    return found or [1]


def _memory(p: Prediction) -> float:
    return p.memory.total


def _predict(
    args: argparse.Namespace, shape: TransformerShape, cluster: Cluster
) -> tuple[Prediction, Choices, Prediction]:
    """The prediction of the layout the flags give; what they leave open (a looped
    schedule's stages per process, the micro-batch) is the fastest choice that fits (the
    fastest, if none does), and the choices tried come back with it, and the choice that
    needs the least memory."""
    virtual, micro = _virtual_choices(args, shape), _micro_batch_choices(args, cluster)
    found: list[Prediction] = []
    errors: list[str] = []
    for b in micro:
        for v in virtual:
            try:
                found.append(predict(shape, _layout(args, cluster, v, b)))
            except ValueError as exc:
                errors.append(str(exc))
    if not found:
        raise UsageError(errors[0])
    fits = [p for p in found if p.fits()] or found
    best = min(fits, key=lambda p: p.step_time_s)
    tried = {
        "stages per process": virtual if len(virtual) > 1 else [],
        "micro-batch": micro if args.micro_batch is None else [],
    }
    least = min(found, key=_memory)
    return best, {name: values for name, values in tried.items() if values}, least


def _model_flags(args: argparse.Namespace) -> str:
    """``gpipe train``'s flags for the model planned: its shape, a context that takes the
    planned sequences, its dropout and tying (its vocabulary is its tokenizer's there)."""
    if args.model != "gpt":
        return f"--model {args.model}"
    flags = [
        f"--n-layer {args.n_layer} --d-model {args.d_model} --n-head {args.n_head}",
        f"--d-ff {args.d_ff}" if args.d_ff else "",
        f"--context {args.seq_len} --dropout {0.1 if args.dropout is None else args.dropout:g}",
        "--untied" if args.no_tie_embeddings else "",
    ]
    return " ".join(f for f in flags if f)


def _search(args: argparse.Namespace, shape: TransformerShape, cluster: Cluster) -> int:
    shard = None if args.shard is None else [None if args.shard == "none" else args.shard]
    space = SearchSpace(
        data_parallel=None if args.data_parallel is None else [args.data_parallel],
        tensor_parallel=None if args.tensor_parallel is None else [args.tensor_parallel],
        stages=None if args.stages is None else [args.stages],
        micro_batches=(1, 2, 4, 8) if args.micro_batch is None else (args.micro_batch,),
        schedules=SearchSpace().schedules if args.schedule is None else (args.schedule,),
        virtual_stages=None if args.virtual_stages is None else [args.virtual_stages],
        recompute=RECOMPUTE if args.recompute is None else (args.recompute,),
        shards=SearchSpace().shards if shard is None else shard,
    )
    found = search(
        shape,
        cluster,
        args.global_batch,
        args.seq_len,
        space,
        precision=args.precision or "bf16",
        stack=args.stack,
        top=args.top or 5,
    )
    print_search(found, shape, cluster, _model_flags(args), as_json=args.json)
    if found.trained is not None and args.model == "gpt" and not args.json:
        print(
            f"  (gpipe train's GPT takes its vocabulary from --tokenizer, bytes without one: "
            f"give one of {args.vocab_size:,} ids to train the model planned)"
        )
    if not found.searched:  # nothing could run, let alone fit: the input is at fault
        reasons = "; ".join(f"{why} ({n})" for why, n in found.rejected.most_common())
        print(
            f"gpipe: error: no layout of the {cluster.gpus} GPUs runs this model with "
            f"--global-batch {args.global_batch}: {reasons or 'none to search'}",
            file=sys.stderr,
        )
        return 2
    if not found.best:
        least = found.least
        needs = (
            ""
            if least is None
            else (
                f"; the least memory is {least.memory.total / 2**30:.1f} GiB per GPU "
                f"({least.layout.describe()})"
            )
        )
        print(
            f"gpipe: does not fit: none of {found.searched} layouts fits in "
            f"{cluster.device.memory_gib:g} GiB per GPU{needs}",
            file=sys.stderr,
        )
        return 1
    return 0
