"""``gpipe plan --generate``: each stage's memory while generating: its weights and the KV
cache of ``--batch-size`` sequences of up to ``--seq-len`` tokens in ``--in-flight`` groups
(``gpipe.planning.generation``). The model is built on the meta device."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from gpipe.cli.common import UsageError
from gpipe.errors import counted
from gpipe.planning.generation import GenerationPlan, plan_generation
from gpipe.planning.memory import format_bytes

__all__ = ["add_generation_arguments", "plan_generating"]


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--generate",
        action="store_true",
        help="plan generation instead of training: each stage's weights and the KV cache of "
        "--batch-size sequences of up to --seq-len tokens",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        metavar="N",
        help="with --generate: groups of sequences in flight (default --stages)",
    )


def _bytes_of(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _gpt(args: argparse.Namespace, dtype: torch.dtype) -> tuple[list[int], list[int], int, str]:
    """The GPT's weights and blocks per stage, its key-value width and how it is cut."""
    from gpipe.cli.plan import _config
    from gpipe.models.gpt import Block, build_gpt
    from gpipe.planning.balancing import partition
    from gpipe.runtime.partitions import even_balance, stage_bounds
    from gpipe.training.balance_choice import parse_balance

    layers = build_gpt(_config(args, args.n_layer), device="meta").to(dtype)
    sizes = [_bytes_of(layer) for layer in layers]
    if args.balance == "params":
        balance = partition([float(s) for s in sizes], args.stages)
    else:
        given = parse_balance(args.balance, args.stages, len(layers))
        balance = given or even_balance(len(layers), args.stages)
    weights, attention = [], []
    for start, stop in stage_bounds(balance):
        weights.append(sum(sizes[start:stop]))
        attention.append(sum(isinstance(layers[i], Block) for i in range(start, stop)))
    return weights, attention, args.d_model, f"balance {balance}"


def _kv_width(config: Any) -> int:
    """Numbers a token keeps for its keys (and as many for its values) in one layer."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not kv_heads or not head_dim:
        raise UsageError("the model's config gives no attention heads and head size to count")
    return int(kv_heads) * int(head_dim)


def _cut_by_plan(model: nn.Module, args: argparse.Namespace) -> tuple[list[Any], str]:
    """``model`` cut by its pipeline plan (or the layout read from its modules) on the meta
    device, at ``--split-at`` or by parameters: the stages that generate, each keeping the
    model's own cache (``gpipe plan``'s training plan profiles a traced cut instead, which
    keeps none), and how it was cut."""
    from gpipe.errors import first_line
    from gpipe.splitting import split
    from gpipe.splitting.hf_layout import plan_layout

    at = None if args.split_at is None else args.split_at.split(",")
    try:
        layout = plan_layout(model)  # what split cuts by under plan="hf"
        if at is None and args.stages > layout.n_layers:  # said with the flag typed
            raise UsageError(
                f"--stages {args.stages} is more than the model's {layout.n_layers} decoder "
                "layers (each stage holds at least one)"
            )
        stages = split(model, at=at, parts=None if at else args.stages, plan="hf")
    except UsageError:
        raise
    except Exception as exc:  # CutError, or a model whose layout cannot be read
        raise UsageError(f"--model {args.model}: {first_line(exc)}") from None
    if len(stages) != args.stages:
        cut = "is cut into" if at is None else f"at --split-at {args.split_at} gives"
        raise UsageError(
            f"--model {args.model} {cut} {counted(len(stages), 'stage')}, but --stages asks "
            f"for {args.stages}"
        )
    return list(stages), _how_cut(args, layout.read)


def _how_cut(args: argparse.Namespace, read: bool) -> str:
    """The cut as the header says it: where the user named it, else by what split read."""
    if args.split_at is not None:
        return f"cut at --split-at {args.split_at}"
    return "cut by its module layout" if read else "cut by its plan"


def _split_model(
    args: argparse.Namespace, dtype: torch.dtype
) -> tuple[list[int], list[int], int, str]:
    """A Hugging Face model cut by its plan or module layout: each stage's weights and
    decoder layers, and how it was cut."""
    from gpipe.cli.plan_model import _build
    from gpipe.training.models.resolve import longest_sequence

    model = _build(args).to(device="meta", dtype=dtype)
    if args.seq_len is None:
        args.seq_len = longest_sequence(model)
    if args.seq_len is None:
        raise UsageError(f"--model {args.model}: its longest sequence is unknown; pass --seq-len")
    stages, cut = _cut_by_plan(model, args)
    weights = [_bytes_of(s) for s in stages]
    attention = [s.stop - s.start for s in stages]
    return weights, attention, _kv_width(getattr(model, "config", None)), cut


def plan_generating(args: argparse.Namespace, kind: str, dtype: torch.dtype, memory: int) -> int:
    """Print each stage's memory while generating; 0 if every stage fits ``memory``."""
    if args.in_flight is not None and args.in_flight < 1:
        raise UsageError(f"--in-flight must be a positive integer, got {args.in_flight}")
    if kind == "module":
        raise UsageError(
            f"--generate: --model {args.model} is a module of your own; gpipe plans the KV "
            "cache of the built-in GPT and of Hugging Face models cut by their plan"
        )
    found = _gpt(args, dtype) if kind == "gpt" else _split_model(args, dtype)
    weights, attention, width, cut = found
    in_flight = args.in_flight or args.stages
    result = plan_generation(
        weights,
        attention,
        kv_width=width,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        batch=args.batch_size,
        context=args.seq_len,
        in_flight=in_flight,
    )
    _print(args, result, cut, memory)
    return 0 if result.fits(memory) else 1


def _print(args: argparse.Namespace, result: GenerationPlan, cut: str, memory: int) -> None:
    print(
        f"generating with {args.model}: {counted(result.batch, 'sequence')} of up to "
        f"{counted(result.context, 'token')}, {counted(result.in_flight, 'group')} in flight of "
        f"up to {result.rows_per_group} each ({args.dtype}); "
        f"{counted(len(result.stages), 'stage')}, {cut}"
    )
    header = ["stage", "attention layers", "weights", "KV cache", "growing", "total"]
    header.append(f"fits {format_bytes(memory)}")
    rows = [
        [
            str(i),
            str(s.attention_layers),
            format_bytes(s.weight_bytes),
            format_bytes(s.cache_bytes),
            format_bytes(s.transient_bytes),
            format_bytes(s.total_bytes),
            "yes" if s.total_bytes <= memory else "no",
        ]
        for i, s in enumerate(result.stages)
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
