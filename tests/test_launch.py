"""gpipe.launch shares the machine's cores among the processes it starts, and takes a
number of restarts for torchrun's agent."""

import os

import pytest

from gpipe import launch
from gpipe.training.launch import threads_per_process

from . import launch_cases


def test_cores_are_shared_among_local_processes():
    cores = len(os.sched_getaffinity(0))
    assert threads_per_process(1) == cores
    assert threads_per_process(cores) == 1
    assert threads_per_process(4 * cores) == 1  # never none
    with pytest.raises(ValueError, match="local_processes must be a positive integer, got 0"):
        threads_per_process(0)


def test_launched_processes_get_their_share_unless_told_otherwise():
    assert launch(launch_cases.threads, 2) == {r: threads_per_process(2) for r in (0, 1)}
    assert launch(launch_cases.threads, 2, threads=3) == {0: 3, 1: 3}
    with pytest.raises(ValueError, match="threads must be 'auto', None or a positive integer"):
        launch(launch_cases.threads, 2, threads="many")


def test_max_restarts_must_be_a_non_negative_integer():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_restarts must be a non-negative integer"):
            launch(launch_cases.threads, 2, max_restarts=bad)
