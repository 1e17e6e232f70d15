"""The training job's learning-rate schedule: warm-up, then cosine decay to the floor."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpipe.training.optimization import learning_rate
from gpipe.training.options import TrainOptions


def test_warmup_rises_linearly_to_the_peak():
    opts = TrainOptions(lr=1e-3, min_lr=1e-4, warmup=10, steps=100)
    assert learning_rate(0, opts) == pytest.approx(1e-4)
    assert learning_rate(4, opts) == pytest.approx(5e-4)
    assert learning_rate(10, opts) == pytest.approx(1e-3)


@given(warmup=st.integers(0, 50), extra=st.integers(1, 500))
def test_after_warmup_it_decays_to_min_lr_and_never_below(warmup, extra):
    opts = TrainOptions(lr=3e-3, min_lr=3e-4, warmup=warmup, steps=warmup + extra)
    rates = [learning_rate(s, opts) for s in range(warmup, opts.steps + 5)]
    assert all(a >= b for a, b in itertools.pairwise(rates))
    assert abs(learning_rate(opts.steps, opts) - opts.min_lr) < 1e-12
    assert min(rates) >= opts.min_lr - 1e-12
