"""Causal attention of a sub-sequence (``seq_chunks``): its tokens over the keys of the tokens
before it, all visible, and over its own, causally.

Masking the whole block would be exact but costly: an attention kernel computes every
masked-out score and keeps the mask for its backward. Instead the two parts run apart, each
without a mask (the earlier keys whole, the sub-sequence's own under the kernel's causal
mask, which fits a square block), and are merged by their log-sum-exps, as flash attention
merges its blocks: PyTorch's flash kernel called twice, on a CPU or, in half precision, on
CUDA (``_PastAndOwn``: its backward hands each part the merged output and log-sum-exp, from
which the kernel's backward gives that part's exact share of the gradients). Elsewhere on
CUDA it is PyTorch's lower-right causal bias; with attention dropout on a CPU, the mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["sub_sequence_attention"]

_ops = torch.ops.aten
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _CpuFlash:
    """PyTorch's CPU flash kernel: float32, float64 and half precisions."""

    available = hasattr(_ops, "_scaled_dot_product_flash_attention_for_cpu_backward")

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor, Any]:
        out, lse = _ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, None

    @staticmethod
    def backward(
        grad: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        _: Any,
    ) -> tuple[Tensor, Tensor, Tensor]:
        flash_backward = _ops._scaled_dot_product_flash_attention_for_cpu_backward
        return flash_backward(grad, q, k, v, out, lse, 0.0, causal)


class _CudaFlash:
    """PyTorch's CUDA flash kernel: half precisions, head sizes up to 256 in multiples of 8."""

    available = hasattr(_ops, "_scaled_dot_product_flash_attention_backward")

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor, Any]:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            _ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    @staticmethod
    def backward(
        grad: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        state: Any,
    ) -> tuple[Tensor, Tensor, Tensor]:
        cum_q, cum_k, max_q, max_k, seed, offset = state
        flash_backward = _ops._scaled_dot_product_flash_attention_backward
        return flash_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset
        )


class _PastAndOwn(torch.autograd.Function):
    """``q`` ``[B, H, new, D]`` over ``k``, ``v`` ``[B, H, past + new, D]``: the first ``past``
    keys whole, the last ``new`` causally, each part by a flash kernel (``kernels``), the two
    merged by their log-sum-exps."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, past: int, kernels: Any) -> Tensor:
        before, before_lse, before_state = kernels.forward(
            q, k[..., :past, :], v[..., :past, :], False
        )
        own, own_lse, own_state = kernels.forward(q, k[..., past:, :], v[..., past:, :], True)
        lse = torch.logaddexp(before_lse, own_lse)
        # merged in the log-sum-exps' precision, returned in the queries' (as the kernel's)
        merged = (before_lse - lse).exp()[..., None] * before + (own_lse - lse).exp()[
            ..., None
        ] * own
        out = merged.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.past, ctx.kernels, ctx.states = past, kernels, (before_state, own_state)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        past, kernels, (before_state, own_state) = ctx.past, ctx.kernels, ctx.states
        grad = grad.contiguous()
        dq_before, dk_before, dv_before = kernels.backward(
            grad, q, k[..., :past, :], v[..., :past, :], out, lse, False, before_state
        )
        dq_own, dk_own, dv_own = kernels.backward(
            grad, q, k[..., past:, :], v[..., past:, :], out, lse, True, own_state
        )
        dk = torch.cat([dk_before, dk_own], dim=-2)
        dv = torch.cat([dv_before, dv_own], dim=-2)
        return dq_before + dq_own, dk, dv, None, None


def _kernels(q: Tensor, dropout_p: float) -> Any:
    """The flash kernels that take ``q`` (and its keys and values), or None."""
    if dropout_p != 0.0:
        return None
    if q.device.type == "cpu" and _CpuFlash.available and q.dtype in _CPU_DTYPES:
        return _CpuFlash
    head = q.shape[-1]
    fits = q.dtype in (torch.float16, torch.bfloat16) and head % 8 == 0 and head <= 256
    if q.device.type == "cuda" and _CudaFlash.available and fits:
        return _CudaFlash
    return None


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
    kernels = _kernels(q, dropout_p)
    if kernels is not None:
        out: Tensor = _PastAndOwn.apply(q, k, v, past, kernels)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return out
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q.shape[-2], k.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q.dtype), dropout_p=dropout_p)
