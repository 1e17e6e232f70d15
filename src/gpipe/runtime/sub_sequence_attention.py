"""Causal attention of a sub-sequence (``seq_chunks``): its tokens over the keys of the
sub-sequences before it, all visible, and over its own, causally.

The earlier sub-sequences' keys and values come as they were made, one tensor each, not
joined: what this attention keeps for its backward is then those tensors themselves, shared
with the attention of every later sub-sequence, rather than a growing copy per sub-sequence
(S sub-sequences would keep S (S + 1) / 2 sub-sequences' worth of keys instead of S).

Masking the whole block would be exact but costly: an attention kernel computes every
masked-out score and keeps the mask for its backward. Instead the two parts run apart, each
without a mask (the earlier keys whole, the sub-sequence's own under the kernel's causal
mask, which fits a square block), and are merged by their log-sum-exps, as flash attention
merges its blocks. On a CPU that is PyTorch's flash kernel called twice
(``_PastAndOwn``: its backward hands each part the merged output and log-sum-exp, from
which the kernel's backward gives that part's exact share of the gradients; the earlier keys
are joined for each call and let go after it); on CUDA it is PyTorch's lower-right causal
bias, which its flash and memory-efficient kernels take as is. Where neither applies
(attention dropout on a CPU), the mask is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sub_sequence_attention"]

_ops = torch.ops.aten
_FLASH_CPU = hasattr(_ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
    _ops, "_scaled_dot_product_flash_attention_for_cpu_backward"
)
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _PastAndOwn(torch.autograd.Function):
    """``q`` ``[B, H, new, D]`` over the earlier keys and values (``before``: the keys of
    each earlier sub-sequence, then their values), whole, and over ``k``, ``v``
    ``[B, H, new, D]``, causally; PyTorch's CPU flash kernel on each part."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, *before: Tensor) -> Tensor:
        flash = _ops._scaled_dot_product_flash_attention_for_cpu
        half = len(before) // 2
        past_k, past_v = torch.cat(before[:half], dim=-2), torch.cat(before[half:], dim=-2)
        earlier, earlier_lse = flash(q, past_k, past_v, 0.0, False)
        del past_k, past_v  # joined for the kernel only: the backward joins them again
        own, own_lse = flash(q, k, v, 0.0, True)
        lse = torch.logaddexp(earlier_lse, own_lse)
        # merged in the log-sum-exps' precision, returned in the queries' (as the kernel's)
        merged = (earlier_lse - lse).exp()[..., None] * earlier + (own_lse - lse).exp()[
            ..., None
        ] * own
        out = merged.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *before)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *before = ctx.saved_tensors
        grad = grad.contiguous()
        half = len(before) // 2
        past_k, past_v = torch.cat(before[:half], dim=-2), torch.cat(before[half:], dim=-2)
        flash_backward = _ops._scaled_dot_product_flash_attention_for_cpu_backward
        dq_earlier, dk_earlier, dv_earlier = flash_backward(
            grad, q, past_k, past_v, out, lse, 0.0, False
        )
        del past_k, past_v
        dq_own, dk_own, dv_own = flash_backward(grad, q, k, v, out, lse, 0.0, True)
        lengths = [t.shape[-2] for t in before[:half]]
        dk_before = dk_earlier.split(lengths, dim=-2)
        dv_before = dv_earlier.split(lengths, dim=-2)
        return dq_earlier + dq_own, dk_own, dv_own, *dk_before, *dv_before


def sub_sequence_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keys_before: Sequence[Tensor] = (),
    values_before: Sequence[Tensor] = (),
    *,
    dropout_p: float = 0.0,
    mask: Callable[[torch.dtype], Tensor],
) -> Tensor:
    """Attention of ``q``, ``k``, ``v`` (``[B, H, new, D]``, a sub-sequence's queries, keys
    and values) over the keys and values of the sub-sequences before it (``keys_before``,
    ``values_before``: ``[B, H, n_i, D]`` each, in order) and its own: each new token sees
    every earlier token and itself. ``mask(dtype)`` gives the additive mask where no kernel
    fits."""
    if len(keys_before) != len(values_before):
        raise ValueError(
            f"{len(keys_before)} earlier sub-sequences' keys but {len(values_before)} values"
        )
    if not keys_before:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if _FLASH_CPU and q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in _CPU_DTYPES:
        out: Tensor = _PastAndOwn.apply(q, k, v, *keys_before, *values_before)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return out
    keys = torch.cat([*keys_before, k], dim=-2)
    values = torch.cat([*values_before, v], dim=-2)
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q.shape[-2], keys.shape[-2])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask(q.dtype), dropout_p=dropout_p
    )
