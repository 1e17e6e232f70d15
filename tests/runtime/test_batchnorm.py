"""DeferredBatchNorm: micro-batches normalized by their own statistics, running statistics
tracked once per mini-batch exactly as PyTorch's BatchNorm tracks them on the whole batch."""

import copy

import pytest
import torch
from torch import nn

from gpipe import GPipe
from gpipe.planning.balancing import balance_by_size, balance_by_time
from gpipe.runtime.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm

from ..small_models import bn_model

RELATIVE = 1e-12  # float64, merged statistics against one pass over the concatenated batch

SHAPES = {
    nn.BatchNorm1d: [(20, 3), (20, 3, 7)],
    nn.BatchNorm2d: [(20, 3, 5, 4)],
    nn.BatchNorm3d: [(20, 3, 2, 3, 2)],
}
CASES = [(cls, shape) for cls, shapes in SHAPES.items() for shape in shapes]


def _tilted(shape, step=0):
    """Channels of very different scale and offset, so that a naive merge would drift."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(*shape, dtype=torch.float64, generator=g)
    scale = torch.tensor([1.0, 1e3, 1e-3], dtype=torch.float64)
    view = [1, 3] + [1] * (len(shape) - 2)
    return x * scale.view(view) + (1e4 + step) * scale.view(view)


def _assert_relative(actual, expected):
    error = ((actual - expected).abs() / expected.abs().clamp_min(1e-300)).max().item()
    assert error <= RELATIVE, error


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize(("cls", "shape"), CASES)
def test_running_statistics_equal_batchnorm_on_the_whole_batch(cls, shape, affine, momentum):
    bn = cls(3, affine=affine, momentum=momentum).double()
    dbn = convert_deferred_batch_norm(copy.deepcopy(bn), chunks=4)
    assert type(dbn) is DeferredBatchNorm
    for step in range(3):
        x = _tilted(shape, step)
        bn(x)
        for part in x.split([6, 5, 5, 4]):  # uneven micro-batches
            dbn(part)
        _assert_relative(dbn.running_mean, bn.running_mean)
        _assert_relative(dbn.running_var, bn.running_var)  # unbiased, as PyTorch keeps it
        assert dbn.num_batches_tracked == bn.num_batches_tracked == step + 1


def test_each_microbatch_is_normalized_by_its_own_statistics():
    bn = nn.BatchNorm2d(3).double()
    dbn = convert_deferred_batch_norm(copy.deepcopy(bn), chunks=2)
    x = _tilted((8, 3, 4, 4)).requires_grad_()
    parts = x.split(4)
    out = torch.cat([dbn(p) for p in parts])
    ref = torch.cat(
        [nn.functional.batch_norm(p, None, None, bn.weight, bn.bias, True) for p in parts]
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.sum().backward()
    assert dbn.weight.grad is not None and x.grad is not None


def test_eval_mode_uses_the_running_statistics():
    bn = nn.BatchNorm2d(3).double()
    dbn = convert_deferred_batch_norm(copy.deepcopy(bn), chunks=4)
    x = _tilted((16, 3, 4, 4))
    bn(x)
    for part in x.chunk(4):
        dbn(part)
    bn.eval()
    dbn.eval()
    torch.testing.assert_close(dbn(x), bn(x), rtol=1e-12, atol=1e-12)
    dbn(x)  # eval mode counts nothing
    assert dbn.pending == 0 and dbn.num_batches_tracked == 1


def test_commit_folds_in_however_many_microbatches_were_counted():
    bn = nn.BatchNorm1d(3).double()
    dbn = convert_deferred_batch_norm(copy.deepcopy(bn), chunks=4)
    x = _tilted((6, 3))
    for part in x.chunk(3):  # a short batch: three micro-batches for chunks=4
        dbn(part)
    assert dbn.pending == 3 and dbn.num_batches_tracked == 0
    dbn.commit()
    bn(x)
    _assert_relative(dbn.running_var, bn.running_var)
    dbn.commit()  # nothing pending: nothing changes
    assert dbn.num_batches_tracked == 1


def test_statistics_sent_between_replicas_merge_exactly():
    """The replicas' statistics, packed into one float64 tensor each as the merge gathers
    them and unpacked in replica order: replicas of 3 and 5 rows give BatchNorm's running
    statistics on all 8, a norm that counted nothing stays empty, and the round trip gives
    back each statistic bit for bit in its own dtype."""
    from gpipe.parallel.replicas import packed_statistics, unpacked_statistics

    bn = nn.BatchNorm1d(3).double()
    x = _tilted((8, 3, 2))
    bn(x)
    replicas = []
    for part in x.split([3, 5]):
        counted, idle = (DeferredBatchNorm(3, auto_commit=False).double() for _ in range(2))
        for micro in part.split(2):
            counted(micro)
        replicas.append([counted, idle])
    mine = replicas[0]
    for norm, back in zip(mine, unpacked_statistics(packed_statistics(mine), mine), strict=True):
        sent = norm.pending_statistics()
        assert back[:2] == sent[:2]
        for a, b in zip(back[2:], sent[2:], strict=True):
            assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype)
    gathered = [unpacked_statistics(packed_statistics(norms), mine) for norms in replicas]
    for i, norm in enumerate(mine):
        norm.replace_statistics([statistics[i] for statistics in gathered])
        norm.commit()
    counted, idle = mine
    _assert_relative(counted.running_mean, bn.running_mean)
    _assert_relative(counted.running_var, bn.running_var)
    assert counted.num_batches_tracked == 1 and idle.num_batches_tracked == 0


def test_conversion_keeps_tensors_keys_and_untracked_layers():
    model = nn.Sequential(
        nn.Conv2d(3, 3, 1),
        nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm1d(3, track_running_stats=False)),
    )
    weight = model[1][0].weight
    keys = list(model.state_dict())
    converted = convert_deferred_batch_norm(model, chunks=2)
    assert type(converted[1][0]) is DeferredBatchNorm
    assert type(converted[1][1]) is nn.BatchNorm1d  # tracks nothing: left as it is
    assert converted[1][0].weight is weight  # an optimizer built before keeps working
    assert list(converted.state_dict()) == keys
    dbn = converted[1][0]
    assert convert_deferred_batch_norm(dbn, chunks=2) is dbn
    assert convert_deferred_batch_norm(dbn, chunks=3) is not dbn
    plain = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm1d(3)))
    plain[1][1] = nn.BatchNorm1d(3, track_running_stats=False)
    plain.load_state_dict(converted.state_dict())  # checkpoints move to the plain model


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="chunks must be a positive integer, got 0"):
        DeferredBatchNorm(3, chunks=0)
    with pytest.raises(ValueError, match="2 or more dimensions"):
        DeferredBatchNorm(3)(torch.zeros(3))


def _chunked(model, x, chunks):
    """The reference: the same deferred model run micro-batch by micro-batch in one piece."""
    return torch.cat([model(part) for part in x.chunk(chunks)])


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("rows", [16, 3])  # 3 rows: fewer micro-batches than chunks
def test_gpipe_tracks_running_statistics_once_per_minibatch(checkpoint, rows):
    reference = convert_deferred_batch_norm(bn_model(), chunks=4)
    pipe = GPipe(
        bn_model(),
        [2, 4],
        devices=["cpu"] * 2,
        chunks=4,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(rows, 5, 3, dtype=torch.float64, generator=generator)
        out = pipe(x)
        out.sum().backward()  # recomputation must not count a micro-batch again
        ref = _chunked(reference, x, 4)
        for layer in reference:
            if isinstance(layer, DeferredBatchNorm):
                layer.commit()
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    for mine, theirs in zip(pipe, reference, strict=True):
        if isinstance(theirs, DeferredBatchNorm):
            assert mine.num_batches_tracked == 2
            torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=1e-12, atol=0)
            torch.testing.assert_close(mine.running_var, theirs.running_var, rtol=1e-12, atol=0)
            torch.testing.assert_close(mine.weight.grad, theirs.weight.grad, rtol=1e-12, atol=1e-14)


def test_the_balancing_profilers_leave_running_statistics_alone():
    model = bn_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 5, 3, dtype=torch.float64)
    balance_by_time(2, model, sample, device="cpu", timeout=0.1)
    balance_by_size(2, model, sample, device="cpu")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("fails on its second micro-batch")
        return x


def test_a_failed_step_leaves_no_statistics_behind():
    failing = _Fails()
    pipe = GPipe(
        nn.Sequential(bn_model(), failing),
        [1, 1],
        devices=["cpu"] * 2,
        chunks=4,
        deferred_batch_norm=True,
    )
    reference = convert_deferred_batch_norm(bn_model(), chunks=4)
    x = torch.randn(16, 5, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="second micro-batch"):
        pipe(x)
    pipe(x).sum().backward()  # the next step counts its own micro-batches only
    _chunked(reference, x, 4)
    for mine, theirs in zip(pipe[0], reference, strict=True):
        if isinstance(theirs, DeferredBatchNorm):
            assert mine.num_batches_tracked == 1
            torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=1e-12, atol=0)
