"""The rules ``gpipe plan``'s flags must satisfy, and the values of those not given: each
broken rule is a usage error naming the flag (``gpipe.cli.plan`` runs the plan itself)."""

from __future__ import annotations

import argparse

from gpipe.cli.common import UsageError, multi_stage_schedules
from gpipe.cli.plan_shard import planned_shard
from gpipe.cli.plan_tensor import check_heads
from gpipe.schedules import Placement, traits

__all__ = [
    "PLAN_DEFAULTS",
    "check_model_flags",
    "check_tensor_flags",
    "check_training_flags",
    "given",
    "training_only_flag",
]

# The values of the options not given, filled in once the rules that tell "given" from "not
# given" have run (a 0 given is refused, not taken for the default).
PLAN_DEFAULTS = {
    "stages": 4,
    "chunks": 8,
    "schedule": "gpipe",
    "virtual_stages": 1,
    "checkpoint": "except_last",
    "balance": "even",
    "device_memory": "16GiB",
}


def check_model_flags(args: argparse.Namespace, *more: str) -> None:
    """The GPT's shape and the counts in ``more`` are positive; the heads divide the width."""
    for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "batch_size", *more):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.n_head is not None and args.d_model % args.n_head:
        raise UsageError(f"--d-model {args.d_model} must be a multiple of --n-head {args.n_head}")


def given(value: object) -> bool:
    """Whether an option was given: a switch on, or any value, 0 among them (``0 in (None,
    False)`` holds, as 0 == False)."""
    return value is not None and value is not False


def check_training_flags(args: argparse.Namespace, gpt: bool) -> None:
    """A memory plan of training (no ``--suggest``): the defaults filled in, then the
    schedule, its stages and micro-batches, the data parallel rows and the balance checked;
    for the built-in GPT (``gpt``), the stages against its layers."""
    for flag in ("suggest", "max_stages", "measure", "top"):
        if given(getattr(args, flag)):
            raise UsageError(
                f"--{flag.replace('_', '-')} needs --suggest (or --cluster's --search)"
            )
    for name, value in PLAN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_model_flags(args, "stages", "chunks", "virtual_stages", "data_parallel")
    if args.batch_size < args.data_parallel:
        raise UsageError(
            f"--batch-size {args.batch_size} cannot give each of --data-parallel "
            f"{args.data_parallel} replicas a row"
        )
    planned_shard(args)
    schedule = traits(args.schedule)
    if args.virtual_stages > 1 and not schedule.several_stages_per_rank:
        raise UsageError(f"--virtual-stages needs --schedule {multi_stage_schedules()}")
    if schedule.placement is Placement.V:  # a V holds two stages a process, unasked
        args.virtual_stages = schedule.stages_per_rank(args.virtual_stages)
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


def check_tensor_flags(args: argparse.Namespace, kind: str) -> None:
    """``--tensor-parallel`` and ``--tp-link``: training plans of the built-in GPT or of a
    Hugging Face model (``kind`` ``gpt`` or ``hf``), T positive and, for the GPT, a divisor of
    its heads (the rest of the plan, the vocabulary among it, is checked where the model is
    split); ``--tp-link`` only where ``--suggest`` times the collectives on it."""
    t = args.tensor_parallel
    if t is None or t == 1:
        if args.tp_link is not None and not args.suggest:
            raise UsageError("--tp-link is the link of --tensor-parallel T's ranks: give T > 1")
        return
    if t < 1:
        raise UsageError(f"--tensor-parallel must be a positive integer, got {t}")
    if kind == "module":
        raise UsageError(
            f"--tensor-parallel plans the split the built-in GPT or a Hugging Face config "
            f"declares; for --model {args.model} plan one rank of each stage (T = 1)"
        )
    if args.generate:
        raise UsageError("--tensor-parallel plans training; leave out --generate")
    if args.tp_link is not None and not args.suggest:
        raise UsageError(
            f"--tp-link {args.tp_link} times the collectives --suggest weighs; a plan of one "
            "configuration counts memory only: leave it out, or add --suggest"
        )
    if kind == "gpt":
        check_heads(t, args.n_head)


# Options of training plans that generation has no use for: one pipeline (generate() runs no
# replicas), one stage per process and no schedule, no micro-batches, no backward to
# recompute for, nothing searched or timed.
_TRAINING_ONLY = (
    "schedule",
    "virtual_stages",
    "suggest",
    "max_layers",
    "chunks",
    "checkpoint",
    "measure",
    "top",
    "max_stages",
    "reshard_after_forward",
)


def training_only_flag(args: argparse.Namespace) -> str | None:
    """The first option given that only a training plan reads, which --generate would ignore."""
    if args.data_parallel != 1:  # 1 where not given
        return "data_parallel"
    if args.shard not in (None, "none"):
        return "shard"
    return next((flag for flag in _TRAINING_ONLY if given(getattr(args, flag))), None)
