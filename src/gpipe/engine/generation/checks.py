"""The arguments of ``generate``, checked on the first stage (which holds the prompts and the
embedding) before anything runs: each refusal is one line naming what was given."""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.engine.generation.sampling import Sampling

__all__ = ["Settings", "checked_prompts", "checked_settings"]


@dataclass(frozen=True)
class Settings:
    """What every stage needs to know of a generation, as the first stage decided it;
    ``context``: the model's, that no sequence outgrows (None: unknown); ``rows_per_lane``:
    the most sequences a lane holds at once (None: every prompt, spread over the lanes)."""

    max_new_tokens: int
    sampling: Sampling
    eos_token_id: int | None
    in_flight: int
    prefill_chunk: int | None
    context: int | None = None
    rows_per_lane: int | None = None


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is one: a Python, numpy or one-number torch integer (no
    bool of any kind); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        kind = value.dtype
        if value.dim() or kind == torch.bool or kind.is_floating_point or kind.is_complex:
            return None
        return int(value.item())
    if isinstance(value, numbers.Integral):
        return int(value)
    return None


def _real(value: Any) -> float | None:
    """``value`` as a finite float if it is a real number: a Python, numpy or one-number
    torch one (no bool, no complex); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() or value.dtype == torch.bool or value.dtype.is_complex:
            return None
        real = float(value.item())
    elif isinstance(value, numbers.Real):
        try:
            real = float(value)
        except OverflowError:  # an int past any float: no finite number
            return None
    else:
        return None
    return real if math.isfinite(real) else None


def _positive(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    number = _integer(value)
    if number is None or number < 1:
        raise ValueError(
            f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}"
        )
    return number


def _token(value: Any, prompt: int, position: int) -> int:
    token = _integer(value)
    if token is None:
        raise TypeError(
            f"prompt {prompt} holds {value!r} at position {position}: prompts are lists of "
            "token ids (ints)"
        )
    return token


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _not_a_prompt(value: Any) -> str | None:
    """What ``value`` is if it cannot be a prompt's ids in order: text, a mapping or a set
    (iterable, but not over ids in the prompt's order), a 0-d tensor or array (one number,
    which iterates into an error of its own), anything not iterable; None if it can."""
    if getattr(value, "ndim", None) == 0:
        return _a(f"0-d {type(value).__name__}")
    if isinstance(value, (str, bytes, Mapping, Set)) or not hasattr(value, "__iter__"):
        return _a(type(value).__name__)
    return None


def checked_prompts(
    prompts: Any, max_new_tokens: int, vocab: int | None, context: int | None
) -> list[list[int]]:
    """``prompts`` as lists of ints, each non-empty, of the vocabulary, and fitting the
    context with ``max_new_tokens`` more (but the last, which no forward reads)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a list of prompts, each a list of token ids, got "
            f"{type(prompts).__name__}"
        )
    checked = []
    for i, prompt in enumerate(prompts):
        what = _not_a_prompt(prompt)
        if what is not None:
            raise TypeError(f"prompt {i} is {what}: each prompt is a list of token ids")
        ids = [_token(t, i, at) for at, t in enumerate(prompt)]
        if not ids:
            raise ValueError(f"prompt {i} is empty: give at least one token id")
        top = vocab if vocab is not None else float("inf")
        bad = next(((at, t) for at, t in enumerate(ids) if not 0 <= t < top), None)
        if bad is not None and vocab is not None:
            raise ValueError(
                f"prompt {i} holds token id {bad[1]} at position {bad[0]}, outside the "
                f"model's vocabulary of {vocab} ids (0 to {vocab - 1})"
            )
        if context is not None and len(ids) > context:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, more than the model's context of {context}"
            )
        fed = len(ids) + max_new_tokens - 1  # the last new token is never fed back
        if context is not None and fed > context:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens and max_new_tokens={max_new_tokens} more "
                f"would feed the model {fed} (all but the last new one), more than its "
                f"context of {context}"
            )
        checked.append(ids)
    return checked


def checked_settings(
    max_new_tokens: Any,
    *,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    eos_token_id: Any,
    seed: Any,
    in_flight: Any,
    prefill_chunk: Any,
    n_stages: int,
    vocab: int | None,
    context: int | None = None,
    rows_per_lane: Any = None,
) -> Settings:
    """Every argument but the prompts checked; ``seed=None`` with sampling draws one here."""
    new = _positive("max_new_tokens", max_new_tokens)
    assert new is not None
    heat = _real(temperature)
    if heat is None or heat < 0:
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    k = _positive("top_k", top_k, optional=True)
    nucleus = None if top_p is None else _real(top_p)
    if top_p is not None and (nucleus is None or not 0 < nucleus <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    eos = None if eos_token_id is None else _integer(eos_token_id)
    top = vocab if vocab is not None else float("inf")
    if eos_token_id is not None and (eos is None or not 0 <= eos < top):
        within = f" (0 to {vocab - 1})" if vocab is not None else ""
        raise ValueError(
            f"eos_token_id must be a token id of the vocabulary{within} or None, got "
            f"{eos_token_id!r}"
        )
    drawn = None if seed is None else _integer(seed)
    if seed is not None and drawn is None:
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    lanes = _positive("in_flight", in_flight, optional=True) or n_stages
    chunk = _positive("prefill_chunk", prefill_chunk, optional=True)
    rows = _positive("rows_per_lane", rows_per_lane, optional=True)
    if drawn is None:
        drawn = random.SystemRandom().randrange(2**63)
    return Settings(new, Sampling(heat, k, nucleus, drawn), eos, lanes, chunk, context, rows)
