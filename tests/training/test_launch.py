"""gpipe.launch shares the machine's cores among the processes it starts, takes a number of
restarts for torchrun's agent, names what it cannot pass to a process, and leaves no process
behind when its caller is interrupted or killed."""

import multiprocessing
import os
import re
import signal
import time

import pytest

from gpipe import LaunchError, launch
from gpipe.training.launch import threads_per_process

from . import launch_cases
from .launch_cases import gone


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


def test_what_cannot_be_pickled_is_named():
    with pytest.raises(TypeError, match=r"^fn \(test_what_cannot.*<lambda>\) must be picklable"):
        launch(lambda: 1, 1)
    with pytest.raises(TypeError, match=r"^args must be picklable .* got tuple: Can't pickle"):
        launch(launch_cases.threads, 1, (lambda: 1,))
    with pytest.raises(LaunchError, match=r"rank 0: TypeError: the result of unpicklable_result "
                       r"on rank 0 must be picklable .* got function: Can't pickle"):  # fmt: skip
        launch(launch_cases.unpicklable_result, 1, threads=1)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"args": 5}, "args must be a tuple of fn's arguments, got int"),
        ({"monitor_interval": 0}, "monitor_interval must be a positive number of seconds, got 0"),
    ],
)
def test_bad_arguments_are_named(options, expected):
    with pytest.raises((TypeError, ValueError), match=re.escape(expected)):
        launch(launch_cases.threads, 1, **options)


def _pids(folder, count: int) -> list[int]:
    """The pids the launched processes noted in ``folder``, once all have (two minutes at
    most)."""
    deadline = time.monotonic() + 120
    while len(found := sorted(folder.glob("pid-[0-9]"))) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} processes started"
        time.sleep(0.05)
    return [int(p.read_text()) for p in found]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see the processes end")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_or_killed_caller_leaves_no_process_behind(tmp_path, sig):
    """Ctrl-C (SIGINT) of the process in ``launch`` stops its processes and raises a
    LaunchError naming the signal; killed outright (SIGKILL) it stops nothing, and its
    processes, children of its forkserver, which would run on unwatched, end by themselves
    (a server of its own: the caller starts one, importing torch once)."""
    method = "fork" if sig == signal.SIGINT else "forkserver"  # the caller's own server
    caller = multiprocessing.get_context("forkserver").Process(
        target=launch_cases.wait_in_launch, args=(str(tmp_path), method)
    )
    caller.start()
    pids = _pids(tmp_path, 2)
    os.kill(caller.pid, sig)
    caller.join(timeout=60)
    deadline = time.monotonic() + 60
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(gone, pids)), pids
    if sig == signal.SIGINT:
        expected = "interrupted by SIGINT: stopped the 2 launched processes"
        assert (tmp_path / "error").read_text() == expected
        assert (tmp_path / "signal").read_text() == str(int(signal.SIGINT))  # gpipe exits 130
