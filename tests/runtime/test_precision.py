"""Mixed precision in a pipeline: a caller's autocast, or Pipeline(autocast=...), applies in
every stage, worker threads and recomputations included, as around the plain model."""

import copy

import pytest
import torch
from torch.nn.functional import mse_loss

from gpipe import GPipe

from .. import distributed_cases as cases
from ..small_models import batch, mlp
from ..workers import run

THREADED = [torch.device("cpu", j) for j in range(2)]


def _reference(model, x, y, chunks):
    """The plain model under the same autocast, micro-batch by micro-batch: the same
    computations as the pipeline's, so that the comparison can be exact."""
    outs = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for xm, ym in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            out = model(xm)
            (mse_loss(out.float(), ym) * len(xm) / len(x)).backward()
            outs.append(out)
    return torch.cat(outs)


@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_gpipe_runs_every_partition_under_the_callers_autocast(mode):
    reference = mlp(torch.float32)
    pipe = GPipe(copy.deepcopy(reference), [4, 4], devices=THREADED, chunks=4, checkpoint=mode)
    x, y = batch(16, torch.float32)
    expected = _reference(reference, x, y, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
        assert out.dtype == torch.bfloat16  # the partitions ran under autocast
        loss = sum(
            mse_loss(o.float(), t) * len(o) / len(x)
            for o, t in zip(out.chunk(4), y.chunk(4), strict=True)
        )
    loss.backward()  # recomputation too: without the saved autocast it fails here
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name.split(".", 2)[2]].grad, rtol=1e-6, atol=1e-7)


def test_pipeline_autocast_matches_the_plain_model_under_autocast_everywhere():
    results = run(cases.autocast, 2, threads=1)
    assert results[0] == results[1] == 4 * 3


def test_an_autocast_dtype_the_device_cannot_take_is_named():
    from gpipe.runtime.recompute import check_autocast

    with pytest.raises(ValueError, match="autocast=torch.float32 is not supported on cpu"):
        check_autocast(torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match="autocast must be a torch.dtype or None, got 'bf16'"):
        check_autocast("bf16", torch.device("cpu"))
    assert check_autocast(torch.bfloat16, torch.device("cpu")) is torch.bfloat16


def test_loss_scaling_steps_or_skips_on_every_rank_alike():
    results = run(cases.loss_scaling, 2, threads=1)
    for rank, r in results.items():
        assert r["scale_after_clean"] == 1024.0, rank  # growth waits for 2000 clean steps
        assert r["skipped"] is True and r["unchanged"] is True, rank
        assert r["scale_after_inf"] == 512.0, rank
    assert results[1]["losses"] == 4 and results[0]["losses"] is None
