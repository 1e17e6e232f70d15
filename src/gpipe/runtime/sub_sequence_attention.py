"""Causal attention of a sub-sequence (``seq_chunks``): its tokens over the keys of the tokens
before it, all visible, and over its own, causally.

Masking the whole block would be exact but costly: an attention kernel computes every
masked-out score and keeps the mask for its backward. Instead the two parts run apart, each
without a mask (the earlier keys whole, the sub-sequence's own under the kernel's causal
mask, which fits a square block), and are merged by their log-sum-exps, as flash attention
merges its blocks. On a CPU that is PyTorch's flash kernel called twice
(``_PastAndOwn``: its backward hands each part the merged output and log-sum-exp, from
which the kernel's backward gives that part's exact share of the gradients); on CUDA it is
PyTorch's lower-right causal bias, which its flash and memory-efficient kernels take as is.
Where neither applies (attention dropout on a CPU), the mask is used.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """``q`` ``[B, H, new, D]`` over ``k``, ``v`` ``[B, H, past + new, D]``: the first ``past``
    keys whole, the last ``new`` causally; PyTorch's CPU flash kernel on each part."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, past: int) -> Tensor:
        flash = _ops._scaled_dot_product_flash_attention_for_cpu
        before, before_lse = flash(q, k[..., :past, :], v[..., :past, :], 0.0, False)
        own, own_lse = flash(q, k[..., past:, :], v[..., past:, :], 0.0, True)
        lse = torch.logaddexp(before_lse, own_lse)
        # merged in the log-sum-exps' precision, returned in the queries' (as the kernel's)
        merged = (before_lse - lse).exp()[..., None] * before + (own_lse - lse).exp()[
            ..., None
        ] * own
        out = merged.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.past = past
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        past, grad = ctx.past, grad.contiguous()
        flash_backward = _ops._scaled_dot_product_flash_attention_for_cpu_backward
        dq_before, dk_before, dv_before = flash_backward(
            grad, q, k[..., :past, :], v[..., :past, :], out, lse, 0.0, False
        )
        dq_own, dk_own, dv_own = flash_backward(
            grad, q, k[..., past:, :], v[..., past:, :], out, lse, 0.0, True
        )
        dk = torch.cat([dk_before, dk_own], dim=-2)
        dv = torch.cat([dv_before, dv_own], dim=-2)
        return dq_before + dq_own, dk, dv, None


def sub_sequence_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past: int,
    *,
    dropout_p: float = 0.0,
    mask: Callable[[torch.dtype], Tensor],
) -> Tensor:
    """Attention of ``q`` (``[B, H, new, D]``, the sub-sequence's queries) over ``k`` and ``v``
    (``[B, H, past + new, D]``): each new token sees every earlier token and itself.
    ``mask(dtype)`` gives the additive mask where no kernel fits."""
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q.shape[-2], k.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)
    if _FLASH_CPU and q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in _CPU_DTYPES:
        out: Tensor = _PastAndOwn.apply(q, k, v, past)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q.dtype), dropout_p=dropout_p)
