"""Pipeline(shard="full"): each stage's parameters, gradients and optimizer state split over
its replicas by fully_shard, with the gradients and weights of unsharded training."""

from . import sharding_cases as cases
from .workers import run


def test_every_schedule_sharded_matches_one_unpipelined_step_and_the_unsharded_replicas():
    """D = 2 x K = 2, float64, checkpoint never and always: loss and every gathered gradient
    equal one step of the plain model on the union of the rows; AdamW after three steps
    equals the unsharded replicas' weights within 1e-12."""
    results = run(cases.exactness, 4, threads=1)
    assert all(r["cases"] == 16 for r in results.values())
    # names as in the whole nn.Sequential, sharded or not
    assert results[0]["names"][:2] == ["0.weight", "0.bias"]
