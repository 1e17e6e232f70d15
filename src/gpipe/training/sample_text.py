"""Generating text through a trained pipeline: the sample a run ends with, and ``gpipe
sample``'s, the same text from the same checkpoint and seed.

Through ``Pipeline.generate`` where every stage keeps a KV cache; past the context, a window
that is full starts the next from its last half. A model whose stages keep no cache (a
module of your own, a traced model) runs its whole window again for every token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpipe.engine.generation import GenerationRefused
from gpipe.pipeline import Pipeline
from gpipe.training.data.tokenizer import ByteTokenizer, Tokenizer
from gpipe.training.models.sources import logits_of

__all__ = ["continued", "generate_text"]


def continued(
    pipe: Pipeline,
    ids: list[int],
    tokens: int,
    context: int,
    *,
    seed: int,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> list[int]:
    """``tokens`` new tokens after ``ids`` through ``pipe.generate`` (collective), however
    many the context holds: the first window is the end of ``ids``; when a window is full,
    the next starts from its last ``context // 2`` tokens, drawn with the seed plus the
    window's number."""
    new: list[int] = []
    window = 0
    while len(new) < tokens:
        text = ids + new
        keep = context - 1 if window == 0 else max(1, context // 2)
        prompt = text[-keep:]
        count = min(tokens - len(new), context - len(prompt))
        found = pipe.generate(
            [prompt], count, temperature=temperature, top_k=top_k, seed=seed + window
        )
        new += found[0]
        window += 1
    return new


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
    ``prompt`` (text, or its ids), sampled with ``seed``: by ``continued`` where the stages
    keep a KV cache; otherwise the last stage picks every next token from the whole window
    and tells the others, ``as_inputs`` turning ids into what the model takes, where that is
    more (a model traced for packed documents takes their positions too)."""
    tokenizer = tokenizer or ByteTokenizer()
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    try:
        pipe.generator()
    except GenerationRefused:
        pass
    else:
        return tokenizer.decode(ids + continued(pipe, ids, tokens, seq_len, seed=seed))
    generator = torch.Generator().manual_seed(seed)
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
