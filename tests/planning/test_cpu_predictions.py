"""The CPU predictions of BENCHMARKS.md section 7, through the cluster planner's assembly of
a pipeline from its layers' costs (``stage_costs``, ``pipeline_costs``): still within 10 %
of the steps measured on this machine (the raw figures of benchmarks/results/scaling.json)."""

import json
from pathlib import Path

import pytest

from benchmarks.bench_scaling import predict

_RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "scaling.json"


def test_the_measured_k2_steps_are_predicted_within_10_percent():
    got = json.loads(_RESULTS.read_text())
    model, batch = got["workload"]["model"], got["workload"]["batch"]
    costs = {int(rows): layers for rows, layers in got["costs"].items()}
    link = got["link"]
    bytes_per_row = model["seq_len"] * model["d_model"] * 4
    for m, check in got["k2_check"].items():
        predicted = predict(
            costs,
            link["latency"],
            link["bandwidth"],
            model["n_layer"],
            2,
            int(m),
            batch,
            bytes_per_row,
        )
        assert predicted == pytest.approx(check["predicted"], rel=1e-9)  # as committed
        assert check["measured"] / predicted == pytest.approx(1, abs=0.10), m
