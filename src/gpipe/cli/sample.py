"""``gpipe sample``: text generated from a checkpoint, the whole model in this process."""

from __future__ import annotations

import argparse
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
        "checkpoints), with the whole model in this process: the model the run trained, "
        "the built-in GPT, a Hugging Face model or a module of your own.",
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
    from gpipe.models.gpt import generate
    from gpipe.training.data.tokenizer import IdTokenizer, check_tokenizer, load_tokenizer
    from gpipe.training.models.trained import checkpoint_at, load_trained, trained_model

    positive("tokens", args.tokens)
    positive("top-k", args.top_k)
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be positive, got {args.temperature}")
    try:
        path = checkpoint_at(args.path)
        if args.model is not None:
            _check_model(args.model, trained_model(path).source, path)
        trained = load_trained(path, code=args.model)
        where = args.tokenizer or trained.train.get("tokenizer")
        data = str(trained.train.get("data") or "")
        ids_only = where is None and data.endswith((".bin", ".npy"))  # no text to speak
        tokenizer = IdTokenizer() if ids_only else load_tokenizer(where)
        if not ids_only:
            check_tokenizer(tokenizer, trained.model.vocab_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    how = "token ids such as '17 42 7' (the run read a token file)" if ids_only else "text"
    if prompt.shape[1] == 0 or int(prompt.max()) >= trained.model.vocab_size:
        raise UsageError(
            f"--prompt {args.prompt!r} gives no tokens of the model's vocabulary of "
            f"{trained.model.vocab_size} to continue; give {how}"
        )
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
