"""Pipeline(shard="full"): each stage's parameters, gradients and optimizer state split over
its replicas by fully_shard, with the gradients and weights of unsharded training."""

from gpipe.schedules import SCHEDULES

from ..workers import run
from . import sharding_cases as cases


def test_every_schedule_sharded_matches_one_unpipelined_step_and_the_unsharded_replicas():
    """D = 2 x K = 2, float64, checkpoint never and always: loss and every gathered gradient
    equal one step of the plain model on the union of the rows; AdamW after two steps
    equals the unsharded replicas' weights within 1e-12."""
    results = run(cases.exactness, 4, threads=1)
    assert all(r["cases"] == 2 * len(SCHEDULES) for r in results.values())
    # names as in the whole nn.Sequential, sharded or not
    assert results[0]["names"][:2] == ["0.weight", "0.bias"]


def test_sharding_composes_with_every_option_as_the_unsharded_replicas():
    """Selective recomputation, parameters freed after each forward (zero-bubble's W
    included), autocast, GradScaler with clipping, deferred BatchNorm, skips and tied weights:
    the losses, gradients, norms, evaluations, outputs and weights of unsharded replicas."""
    results = run(cases.compositions, 4, threads=1)
    for r in results.values():
        units = r["1f1b"][0]
        # gathered once a step, reduced once, during the last backward (after the last W)
        assert r["1f1b"] == (units, units, units, units)
        assert r["zero-bubble"] == (units, units, units, 0)
        # freed after every forward: gathered for each of 4 micro-batches' F and B
        gathers, scatters = r["freed zero-bubble"]
        assert (gathers, scatters) == (2 * 4 * units, units)
        # layer 0 or 5 a unit, the stage's own unit holding the rest
        assert r["chosen"] == (2, 2, 2)


def test_a_mixed_precision_policy_gathers_and_computes_in_its_dtype():
    worst = run(cases.mixed_precision, 4, threads=1)
    assert all(0 < w < 1e-5 for w in worst.values())


def test_bad_shard_arguments_are_named():
    errors = run(cases.bad_inputs, 4, threads=1)
    assert len({tuple(e.values()) for e in errors.values()}) == 1  # every rank alike
    e = errors[0]
    assert (
        "shard='full' splits each stage over its replicas and needs data_parallel > 1"
        in (e["alone"])
    )
    assert "got data_parallel=1" in e["alone"]
    assert "shard must be one of None, 'optimizer', 'gradients', 'full'" in e["unknown"]
    assert "got 'zero3'" in e["unknown"]
    assert "shard='optimizer' is not offered: fully_shard reduce-scatters" in e["optimizer"]
    assert "shard='gradients' is not offered" in e["gradients"]
    assert "layer 8 (_Scaled) cannot be wrapped by fully_shard: it holds a scalar" in e["scalar"]


def test_a_sharded_checkpoint_resumes_sharded_unsharded_and_at_another_k(tmp_path):
    """Saved at D = 2 x K = 2 sharded, every rank its shard, in the foreground and in the
    background: the manifest verifies, and the run resumes at D = 2 sharded, at D = 1 and at
    D = 4 x K = 1 sharded with the losses it goes on with itself."""
    results = run(cases.checkpoints, 4, (str(tmp_path),), threads=1)
    r = results[0]
    assert r["problems"] == [[], []]
    assert [p.rsplit("/", 2)[-2:] for p in r["latest"]] == [
        ["foreground", "step-000002"],
        ["background", "step-000002"],
    ]
    assert {tuple(x["losses"]) for x in results.values()} == {tuple(r["losses"])}
    written = sorted(p.name for p in (tmp_path / "foreground" / "step-000002").iterdir())
    assert [n for n in written if n.endswith(".distcp")] == [f"__{i}_0.distcp" for i in range(4)]


def test_a_failed_step_leaves_no_unreduced_gradient_behind():
    assert all(run(cases.failed_step, 4, threads=1).values())
