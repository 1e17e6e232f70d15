"""Every schedule across real processes gives the loss and gradients of un-pipelined
training: K = 1..4, several micro-batch splits, all checkpoint modes."""

import pytest

from gpipe import launch

from . import schedule_cases as cases
from .models import BALANCES


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("k", sorted(BALANCES))
def test_schedule_matches_unpipelined(schedule, k):
    results = launch(cases.equivalence, k, (k, schedule), threads=1)
    assert all(n == 22 for n in results.values())
