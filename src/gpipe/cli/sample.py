"""``gpipe sample``: text generated from a checkpoint: through the run's stages (one process
per stage, as it trained) where they keep a KV cache, else the whole model in this process."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from gpipe.cli.common import UsageError, positive

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sample",
        help="generate text from a checkpoint",
        description="Generate text from a gpipe checkpoint (a run folder or one of its "
        "checkpoints): the model the run trained, the built-in GPT or a Hugging Face model "
        "through the run's stages, one process per stage; a module of your own (or a model "
        "whose stages keep no KV cache) whole in this process. The same checkpoint, prompt "
        "and seed give the run's own sample.",
    )
    p.add_argument("path", metavar="DIR", help="run folder or checkpoint folder")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=300, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer.json or Hugging Face tokenizer folder (default: the run's "
        "--tokenizer; bytes if it had none)",
    )
    p.add_argument(
        "--model",
        help="the run's --model, checked against what the checkpoint holds (the checkpoint "
        "says which model it is); needed for a run of a module of your own "
        "(MODULE:FUNCTION), whose code gpipe runs only when you name it",
    )
    p.set_defaults(command=_sample)


def _sample(args: argparse.Namespace) -> int:
    from gpipe.training.checkpoints.format import DESCRIPTION, read_run_record
    from gpipe.training.data.tokenizer import IdTokenizer, check_tokenizer, load_tokenizer
    from gpipe.training.models.trained import check_code_named, checkpoint_at, trained_model

    positive("tokens", args.tokens)
    positive("top-k", args.top_k)
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UsageError(f"--temperature must be a positive number, got {args.temperature}")
    try:
        path = checkpoint_at(args.path)
        model = trained_model(path)
        if args.model is not None:
            _check_model(args.model, model.source, path)
        check_code_named(model, path / DESCRIPTION, args.model)
        train = dict(read_run_record(path).get("train") or {})
        where = args.tokenizer or train.get("tokenizer")
        data = str(train.get("data") or "")
        ids_only = where is None and data.endswith((".bin", ".npy"))  # no text to speak
        tokenizer = IdTokenizer() if ids_only else load_tokenizer(where)
        if not ids_only:
            check_tokenizer(tokenizer, model.vocab_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    ids = tokenizer.encode(args.prompt)
    how = "token ids such as '17 42 7' (the run read a token file)" if ids_only else "text"
    if not ids or max(ids) >= model.vocab_size:
        raise UsageError(
            f"--prompt {args.prompt!r} gives no tokens of the model's vocabulary of "
            f"{model.vocab_size} to continue; give {how}"
        )
    seq_len = int(train.get("seq_len") or model.seq_len)
    if model.kind in ("gpt", "hf"):
        found = _through_stages(args, path, ids, seq_len)
        if found is not None:
            print(tokenizer.decode(ids + found))
            return 0
    return _in_this_process(args, path, tokenizer, ids)


def _through_stages(
    args: argparse.Namespace, path: Path, ids: list[int], seq_len: int
) -> list[int] | None:
    """The new tokens, through the run's stages; None if they keep no KV cache."""
    from gpipe.training.generation_job import GenerateJob, generate_from_run

    options = {"temperature": args.temperature, "top_k": args.top_k, "seed": args.seed}
    job = GenerateJob(str(path), [ids], args.tokens, options, code=args.model, window=seq_len)
    found = generate_from_run(job)
    return None if found.refused is not None else found.tokens[0]


def _in_this_process(args: argparse.Namespace, path: Path, tokenizer: Any, ids: list[int]) -> int:
    """The whole model in this process, its whole window again for every token."""
    from gpipe.models.gpt import generate
    from gpipe.training.models.trained import load_trained

    try:
        trained = load_trained(path, code=args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    prompt = torch.tensor([ids], dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        tokens = generate(
            trained.logits,
            prompt,
            args.tokens,
            trained.seq_len,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=generator,
        )
    print(tokenizer.decode(tokens[0].tolist()))
    return 0


def _check_model(given: str, held: str, path: Path) -> None:
    """``--model`` must name the model the checkpoint holds (a Hugging Face config by its
    file or its folder alike)."""
    from gpipe.training.models.sources import parse_model

    try:
        kind, target = parse_model(given)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    held_kind, held_target = parse_model(held)
    same = kind == held_kind and (
        _config_path(target) == _config_path(held_target) if kind == "hf" else target == held_target
    )
    if not same:
        raise UsageError(f"--model {given}: the checkpoint {path} holds --model {held}")


def _config_path(target: str) -> Path:
    path = Path(target)
    return (path / "config.json" if path.is_dir() else path).resolve()
