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
        "checkpoints), with the whole model in this process.",
    )
    p.add_argument("path", metavar="DIR", help="run folder or checkpoint folder")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=300, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(command=_sample)


def _sample(args: argparse.Namespace) -> int:
    from gpipe.training.checkpoints import (
        DESCRIPTION,
        latest_checkpoint,
        load_model_weights,
        read_description,
        verify_checkpoint,
    )
    from gpipe.training.data import decode, encode
    from gpipe.training.models.gpt import GPTConfig, build_gpt, generate

    folder = Path(args.path)
    if (folder / DESCRIPTION).is_file():  # one checkpoint, named
        path: Path | None = folder
        problems = verify_checkpoint(folder)
        if problems:
            raise UsageError(f"{folder}: damaged checkpoint ({'; '.join(problems)})")
    else:  # a run folder: its newest checkpoint that verifies
        path = latest_checkpoint(folder / "checkpoints")
    if path is None:
        raise UsageError(f"{folder}: no gpipe checkpoint there")
    positive("tokens", args.tokens)
    positive("top-k", args.top_k)
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be positive, got {args.temperature}")
    config = GPTConfig.from_dict(read_description(path)["model"])
    model = build_gpt(config)
    load_model_weights(path, model)
    model.eval()
    prompt = encode(args.prompt).view(1, -1)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        tokens = generate(
            model,
            prompt,
            args.tokens,
            config.seq_len,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=generator,
        )
    print(decode(tokens[0].tolist()))
    return 0
