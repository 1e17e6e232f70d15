"""Generating text through a trained pipeline: the sample a run ends with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.pipeline import Pipeline
from gpipe.training.data.tokenizer import ByteTokenizer, Tokenizer
from gpipe.training.models.sources import logits_of

__all__ = ["generate_text"]


def generate_text(
    pipe: Pipeline,
    prompt: str | list[int],
    tokens: int,
    seq_len: int,
    seed: int,
    device: torch.device,
    tokenizer: Tokenizer | None = None,
    as_inputs: Callable[[Tensor], Any] | None = None,
) -> str:
    """Generate ``tokens`` tokens (bytes without a tokenizer) through the pipeline after
    ``prompt`` (text, or its ids): the last stage picks every next token and tells the
    others. ``as_inputs`` turns ids into what the model takes, where that is more (a model
    traced for packed documents takes their positions too)."""
    tokenizer = tokenizer or ByteTokenizer()
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    context = torch.tensor([ids], dtype=torch.long)
    pipe.eval()
    for _ in range(tokens):
        window = context[:, -seq_len:]
        inputs = as_inputs(window) if as_inputs is not None else window
        outputs = pipe(inputs if pipe.is_first else None)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        if pipe.is_last:
            probs = torch.softmax(logits_of(outputs)[0, -1].float().cpu(), dim=-1)
            token[0, 0] = torch.multinomial(probs, 1, generator=generator).item()
        if pipe.n_ranks > 1:
            last = pipe.global_rank(pipe.rank_of(pipe.n_stages - 1))
            dist.broadcast(token, src=last, group=pipe.group)
        context = torch.cat([context, token.cpu()], dim=1)
    pipe.train()
    return tokenizer.decode(context[0].tolist())
