"""A sub-sequence's causal attention over the keys before it and its own: the two kernel
calls merged by their log-sum-exps give masked attention's outputs and gradients."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.runtime.sub_sequence_attention import sub_sequence_attention


def _mask(past: int, new: int, dtype: torch.dtype) -> torch.Tensor:
    hidden = torch.arange(past + new)[None, :] > torch.arange(past, past + new)[:, None]
    return torch.zeros(hidden.shape, dtype=dtype).masked_fill(hidden, float("-inf"))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 9), st.integers(1, 7), st.sampled_from([torch.float64, torch.float32]))
def test_outputs_and_gradients_are_masked_attentions(past, new, dtype):
    g = torch.Generator().manual_seed(past * 10 + new)
    q = torch.randn(2, 3, new, 8, generator=g, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(2, 3, past + new, 8, generator=g, dtype=dtype).requires_grad_() for _ in "kv"
    )
    grad = torch.randn(2, 3, new, 8, generator=g, dtype=dtype)
    mask = _mask(past, new, dtype)
    got = sub_sequence_attention(q, k, v, past, mask=lambda d: mask.to(d))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    close = (
        {"rtol": 1e-12, "atol": 1e-12} if dtype is torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    )
    torch.testing.assert_close(got, want, **close)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), grad),
        torch.autograd.grad(want, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(a, b, **close)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_low_precision_it_keeps_the_queries_dtype_and_is_masked_attention(dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 6, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 3, 15, 16, generator=g).to(dtype).requires_grad_() for _ in "kv")
    mask = _mask(9, 6, dtype)
    got = sub_sequence_attention(q, k, v, 9, mask=lambda d: mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    wanted = torch.autograd.grad(want.float().sum(), (q, k, v))
    for a, b in zip(grads, wanted, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_attention_dropout_takes_the_mask():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    asked = []

    def mask(dtype):
        asked.append(dtype)
        return _mask(2, 3, dtype)

    sub_sequence_attention(q, k, v, 2, dropout_p=0.5, mask=mask)
    assert asked == [torch.float32]
    sub_sequence_attention(q, k, v, 2, mask=mask)  # no dropout: the kernels, no mask
    assert asked == [torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_on_cuda_outputs_and_gradients_are_masked_attentions(dtype):
    """PyTorch's lower-right causal bias, in half precisions and float32."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 16, 64, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(2, 4, 48, 64, generator=g).to("cuda", dtype).requires_grad_() for _ in "kv")
    mask = _mask(32, 16, dtype).cuda()
    got = sub_sequence_attention(q, k, v, 32, mask=lambda d: mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    close = {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {}
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **close)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    wanted = torch.autograd.grad(want.float().sum(), (q, k, v))
    for a, b in zip(grads, wanted, strict=True):
        torch.testing.assert_close(a, b, **({"rtol": 5e-2, "atol": 5e-2} if close else {}))
