"""A sub-sequence's causal attention over the keys of the sub-sequences before it and its
own: the two kernel calls merged by their log-sum-exps give masked attention's outputs and
gradients, and what it keeps for its backward is the earlier sub-sequences' own tensors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.runtime.sub_sequence_attention import sub_sequence_attention


def _mask(past: int, new: int, dtype: torch.dtype) -> torch.Tensor:
    hidden = torch.arange(past + new)[None, :] > torch.arange(past, past + new)[:, None]
    return torch.zeros(hidden.shape, dtype=dtype).masked_fill(hidden, float("-inf"))


def _attention(q, k, v, lengths, mask, **options):
    """``sub_sequence_attention`` with the columns of ``k`` and ``v`` cut into earlier
    sub-sequences of ``lengths`` and the query's own (their last ``q.shape[-2]``)."""
    cut = [*lengths, q.shape[-2]]
    *keys_before, own_k = k.split(cut, dim=-2)
    *values_before, own_v = v.split(cut, dim=-2)
    return sub_sequence_attention(q, own_k, own_v, keys_before, values_before, mask=mask, **options)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 5), max_size=3),
    st.integers(1, 7),
    st.sampled_from([torch.float64, torch.float32]),
)
def test_outputs_and_gradients_are_masked_attentions(lengths, new, dtype):
    past = sum(lengths)
    g = torch.Generator().manual_seed(past * 10 + new)
    q = torch.randn(2, 3, new, 8, generator=g, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(2, 3, past + new, 8, generator=g, dtype=dtype).requires_grad_() for _ in "kv"
    )
    grad = torch.randn(2, 3, new, 8, generator=g, dtype=dtype)
    mask = _mask(past, new, dtype)
    got = _attention(q, k, v, lengths, lambda d: mask.to(d))
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
    got = _attention(q, k, v, [4, 5], lambda d: mask)
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

    _attention(q, k, v, [2], mask, dropout_p=0.5)
    assert asked == [torch.float32]
    _attention(q, k, v, [2], mask)  # no dropout: the kernels, no mask
    assert asked == [torch.float32]


def test_it_keeps_the_earlier_sub_sequences_tensors_not_a_joined_copy():
    """The keys and values of S sub-sequences are then kept once, not S (S + 1) / 2 times."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, requires_grad=True) for _ in "qkv")
    before = [torch.randn(1, 2, 4, 8, generator=g, requires_grad=True) for _ in range(4)]
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sub_sequence_attention(q, k, v, before[:2], before[2:], mask=lambda d: None)
    given = {t.untyped_storage().data_ptr() for t in [q, k, v, *before, out]}
    assert given - {out.untyped_storage().data_ptr()} <= set(kept)
    assert len(set(kept) - given) <= 1  # and the log-sum-exp: nothing as long as the keys


def test_earlier_keys_without_their_values_are_refused():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="2 earlier sub-sequences' keys but 1 values"):
        sub_sequence_attention(q, q, q, [q, q], [q], mask=lambda d: None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_on_cuda_outputs_and_gradients_are_masked_attentions(dtype):
    """PyTorch's lower-right causal bias, in half precisions and float32."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 16, 64, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(2, 4, 48, 64, generator=g).to("cuda", dtype).requires_grad_() for _ in "kv")
    mask = _mask(32, 16, dtype).cuda()
    got = _attention(q, k, v, [16, 16], lambda d: mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    close = {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {}
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **close)
    grads = torch.autograd.grad(got.float().sum(), (q, k, v))
    wanted = torch.autograd.grad(want.float().sum(), (q, k, v))
    for a, b in zip(grads, wanted, strict=True):
        torch.testing.assert_close(a, b, **({"rtol": 5e-2, "atol": 5e-2} if close else {}))
