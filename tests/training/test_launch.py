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


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_processes_see_the_callers_directory_and_environment_as_they_are_now(
    method, monkeypatch, tmp_path
):
    """The forkserver starts once, with the environment of its first launch; later launches
    must still hand over the caller's current directory and variables, removals included."""
    names = ["GPIPE_PROBE_SET", "GPIPE_PROBE_GONE"]
    monkeypatch.setenv("GPIPE_PROBE_GONE", "here")
    if method == "forkserver":
        launch(launch_cases.threads, 2, start_method=method)  # the server starts with these
    monkeypatch.delenv("GPIPE_PROBE_GONE")
    monkeypatch.setenv("GPIPE_PROBE_SET", method)
    monkeypatch.chdir(tmp_path)
    seen = launch(launch_cases.surroundings, 2, (names,), start_method=method)
    for rank, there in seen.items():
        assert there["cwd"] == str(tmp_path)
        assert there["env"] == {"GPIPE_PROBE_SET": method, "GPIPE_PROBE_GONE": None}
        assert there["rank"] == str(rank)  # what torchrun's agent sets wins
        assert there["torch_preloaded"]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_processes_write_where_the_callers_output_goes_now(method, capfd):
    """A forkserver started before the caller's output was redirected (here, by capfd) still
    gives each process the caller's stdout and stderr as they are at the launch."""
    if method == "forkserver":
        with capfd.disabled():
            launch(launch_cases.threads, 2, start_method=method)  # the server starts here
    launch(launch_cases.speak, 2, ("hello",), start_method=method)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"hello on stdout from rank {rank}" in out
        assert f"hello written to fd 1 by rank {rank}" in out
        assert f"hello on stderr from rank {rank}" in err


def test_an_unknown_start_method_is_named():
    with pytest.raises(ValueError, match=r"start_method must be one of \('forkserver', 'spawn', "):
        launch(launch_cases.threads, 2, start_method="thread")
