"""``gpipe plan --model`` and ``--tokenizer``: the model a plan is for, as ``gpipe train``
takes it. The built-in GPT is planned from one profiled block (``gpipe.cli.plan``); a Hugging
Face causal LM (``hf:PATH``) or a factory's module (``MODULE:FUNCTION``) is built on the meta
device, cut by ``gpipe.split`` into the stages, and each stage profiled whole.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpipe.cli.common import UsageError
from gpipe.cli.plan_shard import plan_options
from gpipe.errors import first_line
from gpipe.planning.memory import MemoryPlan, plan, profile
from gpipe.training.models.resolve import longest_sequence, quiet_tracer

if TYPE_CHECKING:
    from gpipe.training.data.tokenizer import Tokenizer

__all__ = ["GPT_DEFAULTS", "add_model_arguments", "check_split_options", "model_kind", "plan_split"]

GPT_DEFAULTS = {"n_layer": 12, "d_model": 768, "n_head": 12, "vocab_size": 50257}
_GPT_FLAGS = ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "no_tie_embeddings")
_SEQ_LEN = 1024  # the GPT's default --seq-len


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, the GPT's shape, ``--seq-len``, ``--tokenizer`` and ``--split-at``."""
    p.add_argument(
        "--model",
        default="gpt",
        help="gpt (the built-in GPT, shaped by the flags below; the default), hf:PATH (a "
        "Hugging Face causal LM's config.json or folder) or MODULE:FUNCTION (a factory of "
        "an nn.Module): the latter two are cut by gpipe.split on the meta device",
    )
    p.add_argument("--n-layer", type=int, help="GPT: transformer blocks (default 12)")
    p.add_argument("--d-model", type=int, help="GPT: residual width (default 768)")
    p.add_argument("--n-head", type=int, help="GPT: attention heads (default 12)")
    p.add_argument("--d-ff", type=int, help="GPT: MLP width (default 4 x d-model)")
    p.add_argument(
        "--vocab-size", type=int, help="GPT: vocabulary (default --tokenizer's, else 50257)"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: the model's longest; the GPT's 1024)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer.json or Hugging Face tokenizer folder, refused unless its "
        "vocabulary fits the model's",
    )
    p.add_argument(
        "--split-at",
        metavar="NAME,...",
        help="hf: or MODULE:FUNCTION: the submodules where stages begin (default: cut by "
        "parameters)",
    )
    p.add_argument(
        "--no-tie-embeddings", action="store_true", help="GPT: separate embedding and head weights"
    )


def model_kind(args: argparse.Namespace) -> str:
    """``--model``'s kind (``gpt``, ``hf`` or ``module``), its flags checked: the GPT's shape
    flags only with the GPT, whose defaults (and vocabulary, from ``--tokenizer``) are filled
    in here; ``--split-at`` only with a model that ``gpipe.split`` cuts."""
    from gpipe.training.models.sources import parse_model

    try:
        kind, _ = parse_model(args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if kind != "gpt":
        given = [
            f"--{f.replace('_', '-')}" for f in _GPT_FLAGS if getattr(args, f) not in (None, False)
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)}: the built-in GPT's flags, but --model {args.model} gives "
                "the model; set its shape in its own config or factory"
            )
        return kind
    if args.split_at is not None:
        raise UsageError("--split-at cuts a model given by --model hf:... or MODULE:FUNCTION")
    tokenizer = None if args.tokenizer is None else _tokenizer(args)
    if args.vocab_size is None and tokenizer is not None:
        args.vocab_size = tokenizer.vocab_size
    for name, value in GPT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.seq_len is None:
        args.seq_len = _SEQ_LEN
    if tokenizer is not None:
        _check_tokenizer(tokenizer, args.vocab_size)
    return kind


def _tokenizer(args: argparse.Namespace) -> Any:
    from gpipe.training.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(args.tokenizer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> None:
    from gpipe.training.data.tokenizer import check_tokenizer

    try:
        check_tokenizer(tokenizer, vocab_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_split_options(args: argparse.Namespace) -> None:
    """Refuse, in one line, what only the GPT's plan does; the cut is by parameters."""
    if args.suggest:
        raise UsageError(
            f"--suggest searches the built-in GPT's layers; for --model {args.model} plan one "
            "configuration at a time (--stages, --chunks, --schedule, --checkpoint)"
        )
    if args.max_layers:
        raise UsageError(
            f"--max-layers grows the built-in GPT; --model {args.model} has the depth its "
            "config or factory gives"
        )
    if args.balance not in (None, "params"):
        raise UsageError(
            f"--balance {args.balance}: --model {args.model} is cut by gpipe.split by "
            "parameters, or at --split-at NAME,..."
        )
    args.balance = "params"


def plan_split(args: argparse.Namespace, dtype: torch.dtype) -> tuple[MemoryPlan, list[str]]:
    """The memory plan of ``--model hf:PATH`` or ``MODULE:FUNCTION`` cut into ``--stages`` x
    ``--virtual-stages`` stages, and where each stage begins. The model is built on the meta
    device in ``dtype`` and its stages profiled there on ``--seq-len`` tokens (by default the
    model's longest sequence)."""
    from gpipe.training.models.sources import model_loss

    tokenizer = None if args.tokenizer is None else _tokenizer(args)
    model = _build(args).to(device="meta", dtype=dtype)
    if args.seq_len is None:
        args.seq_len = longest_sequence(model)
    if args.seq_len is None:
        raise UsageError(
            f"--model {args.model}: its longest sequence is unknown (no max_seq_len, seq_len or "
            "config.max_position_embeddings attribute); pass --seq-len"
        )
    if tokenizer is not None:
        _check_tokenizer(tokenizer, _vocab_size(model, args.model))
    parts = args.stages * args.virtual_stages
    stages = _split(model, args, parts)
    sample = torch.zeros(min(2, args.batch_size), args.seq_len, dtype=torch.long, device="meta")
    prof = profile(stages, sample, target=sample, loss_fn=model_loss)
    result = plan(prof, [1] * parts, **plan_options(args))
    return result, ["(input)", *stages.at]


def _build(args: argparse.Namespace) -> nn.Module:
    """The model ``--model`` names, parameters on meta for ``hf:`` (a factory's module is
    built as its factory builds it, then moved)."""
    from gpipe.training.models.sources import call_factory, parse_model

    kind, target = parse_model(args.model)
    try:
        if kind == "hf":
            from gpipe.training.hf.models import build_hf_meta

            return build_hf_meta(target)
        return call_factory(target, 0)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _split(model: nn.Module, args: argparse.Namespace, parts: int) -> Any:
    """``model`` cut by ``gpipe.split`` into ``parts`` stages: at ``--split-at``, or where
    their parameters are most even; with ``--tensor-parallel T``, each stage as one of its T
    ranks holds it. Its errors as one line."""
    from gpipe.splitting import PlanStage

    at = None if args.split_at is None else args.split_at.split(",")
    t = getattr(args, "tensor_parallel", None) or 1
    if at is None or t > 1:
        planned = _traced(model, args, at=at, parts=None if at else parts, plan="auto")
        if not isinstance(planned[0], PlanStage):
            if t > 1:
                raise UsageError(
                    f"--tensor-parallel {t}: --model {args.model} declares no pipeline plan "
                    "(base_model_pp_plan) to split its layers by; plan it with T = 1"
                )
            return _counted(planned, args, parts)
        at = planned.at
        if t > 1:
            model = _one_rank(model, planned, t)
    # profiled on meta, where a model's own code cannot run (it reads values): the traced
    # graph of the same cut (where a plan cut it, as training will)
    return _counted(_traced(model, args, at=at, parts=None, plan=None), args, parts)


def _traced(model: nn.Module, args: argparse.Namespace, **how: Any) -> Any:
    """``gpipe.split(model, ..., **how)`` on a few tokens on meta, its errors as one line."""
    from gpipe.splitting import split

    example = torch.zeros(2, min(args.seq_len, 16), dtype=torch.long, device="meta")
    try:  # the tracer prints the graph it gave up on, and logs: the message says it all
        with quiet_tracer():
            return split(model, (example,), balance="parameters", **how)
    except Exception as exc:  # TraceError, CutError, or the tracer's own
        raise UsageError(f"--model {args.model}: {first_line(exc)}") from None


def _counted(stages: Any, args: argparse.Namespace, parts: int) -> Any:
    """``stages``, refused in one line unless they are the ``parts`` asked for."""
    if len(stages) != parts:
        raise UsageError(
            f"--split-at {args.split_at} gives {len(stages)} stages, but --stages {args.stages} "
            f"x --virtual-stages {args.virtual_stages} asks for {parts}"
        )
    return stages


def _one_rank(model: nn.Module, planned: Any, tensor_parallel: int) -> nn.Module:
    """``model`` with each module its declared tensor-parallel plan splits in the shape one
    of ``tensor_parallel`` ranks holds (``gpipe.planning.tensor_share``), the plan checked
    first on ``planned``'s stages as ``gpipe train --tensor-parallel`` checks it."""
    from gpipe.parallel.tensor import resolve_plan
    from gpipe.planning.tensor_share import local_share

    whole: dict[str, Any] = {}
    for stage in planned:
        whole.update(stage.tp_plan)
    try:
        resolve_plan(None, nn.Sequential(*planned), tensor_parallel)
        share = local_share([model], tensor_parallel, {f"0.{k}": v for k, v in whole.items()})
    except ValueError as exc:
        raise UsageError(f"--tensor-parallel {tensor_parallel}: {exc}") from None
    return share[0]


def _vocab_size(model: nn.Module, source: str) -> int:
    """The model's vocabulary: its config's, or the width of its logits (on meta)."""
    from gpipe.training.models.sources import logits_of

    found = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(found, int):
        return found
    try:
        with torch.no_grad():
            return int(
                logits_of(model(torch.zeros(2, 4, dtype=torch.long, device="meta"))).shape[-1]
            )
    except (TypeError, RuntimeError) as exc:
        raise UsageError(
            f"--model {source}: the model must take token ids [batch, tokens] and return "
            f"logits [batch, tokens, vocabulary] ({exc})"
        ) from None
