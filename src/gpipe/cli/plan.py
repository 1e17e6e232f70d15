"""``gpipe plan``: will this model fit on K devices, and how many layers would?

The model is built and profiled on the meta device, so planning a model with billions of
parameters takes neither memory nor compute.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from ..checkpointing import CHECKPOINT_MODES
from ..memory import OPTIMIZER_STATES, MemoryPlan, Profile, plan, profile
from ..schedule import SCHEDULES
from .common import UsageError

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


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="predict memory per stage; find the most layers that fit",
        description="Predict each process's peak memory (parameters, gradients, optimizer "
        "state and activations) for a model cut into pipeline stages, without allocating "
        "it: the model is profiled on the meta device.",
    )
    p.add_argument("--model", choices=["gpt"], default="gpt", help="model family (default gpt)")
    p.add_argument("--n-layer", type=int, default=12, help="transformer blocks (default 12)")
    p.add_argument("--d-model", type=int, default=768, help="residual width (default 768)")
    p.add_argument("--n-head", type=int, default=12, help="attention heads (default 12)")
    p.add_argument("--d-ff", type=int, help="MLP width (default 4 x d-model)")
    p.add_argument("--vocab-size", type=int, default=50257, help="vocabulary (default 50257)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument(
        "--no-tie-embeddings", action="store_true", help="separate embedding and head weights"
    )
    p.add_argument("--stages", type=int, default=4, metavar="K", help="processes (default 4)")
    p.add_argument("--chunks", type=int, default=8, metavar="M", help="micro-batches (default 8)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--schedule", choices=SCHEDULES, default="gpipe", help="default gpipe")
    p.add_argument(
        "--virtual-stages", type=int, default=1, help="stages per process with interleaved"
    )
    p.add_argument(
        "--checkpoint", choices=CHECKPOINT_MODES, default="except_last", help="re-materialization"
    )
    p.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam", help="default adam"
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="default float32")
    p.add_argument(
        "--balance",
        default="even",
        help="where to cut: even (default), params, or layers per stage such as 3,3",
    )
    p.add_argument("--device-memory", default="16GiB", help="memory of one device (default 16GiB)")
    p.add_argument(
        "--max-layers", action="store_true", help="find the most blocks that fit, then plan it"
    )
    p.set_defaults(command=_plan)


def _config(args: argparse.Namespace, n_layer: int) -> Any:
    from ..models.gpt import GPTConfig

    return GPTConfig(
        n_layer=n_layer,
        d_model=args.d_model,
        n_head=args.n_head,
        d_ff=args.d_ff,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        tied=not args.no_tie_embeddings,
    )


def _template(args: argparse.Namespace) -> Profile:
    """The profile of a one-block model; deeper models repeat its block (``Profile.repeat``)."""
    from ..models.gpt import build_gpt, lm_loss

    layers = build_gpt(_config(args, 1), device="meta").to(_DTYPES[args.dtype])
    tokens = torch.zeros(min(2, args.batch_size), args.seq_len, dtype=torch.int64, device="meta")
    return profile(layers, tokens, target=tokens, loss_fn=lm_loss)


def _plan_for(args: argparse.Namespace, template: Profile, n_layer: int) -> MemoryPlan:
    from ..balance import partition
    from ..partition import even_balance
    from ..train import parse_balance

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
    )


def _check(args: argparse.Namespace) -> None:
    for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "stages", "chunks",
                 "batch_size", "virtual_stages"):  # fmt: skip
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.d_model % args.n_head:
        raise UsageError(f"--d-model {args.d_model} must be a multiple of --n-head {args.n_head}")
    if args.virtual_stages > 1 and args.schedule != "interleaved":
        raise UsageError("--virtual-stages needs --schedule interleaved")
    if args.schedule == "interleaved" and args.chunks % args.stages:
        raise UsageError(
            f"--schedule interleaved needs --chunks a multiple of --stages {args.stages}"
        )
    if args.balance == "time":
        raise UsageError(
            "--balance time needs a run to time; gpipe plan cuts even, by params or as given"
        )
    if args.max_layers and args.balance not in ("even", "params"):
        raise UsageError("--max-layers cuts each candidate itself: --balance even or params")
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
    _check(args)
    try:
        memory = parse_bytes(args.device_memory)
        template = _template(args)
        n_layer = args.n_layer
        if args.max_layers:
            most = _most_layers(args, template, memory)
            if most is None:
                print(f"not even the smallest model fits in {_size(memory)} per device")
                return 1
            n_layer = most
        result = _plan_for(args, template, n_layer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _print(args, n_layer, result, memory)
    return 0 if result.fits(memory) else 1


def _print(args: argparse.Namespace, n_layer: int, result: MemoryPlan, memory: int) -> None:
    params = sum(r.params for r in result.ranks)
    heading = "most blocks that fit" if args.max_layers else "blocks"
    print(
        f"gpt: {heading} {n_layer}, d_model {args.d_model}, {params / 1e6:,.1f} M parameters "
        f"({args.dtype}); {args.stages} stages, balance {list(result.balance)}, "
        f"{args.schedule}, {args.chunks} micro-batches of {args.batch_size} sequences, "
        f"checkpoint {args.checkpoint}, {args.optimizer}"
    )
    header = ["rank", "layers", "parameters", "weights", "grads+optimizer", "activations",
              "total", f"fits {_size(memory)}"]  # fmt: skip
    rows = [
        [
            str(r.rank),
            str(r.layers),
            f"{r.params / 1e6:,.1f} M",
            _size(r.param_bytes),
            _size(r.state_bytes),
            _size(r.activation_bytes),
            _size(r.total_bytes),
            "yes" if r.total_bytes <= memory else "no",
        ]
        for r in result.ranks
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
