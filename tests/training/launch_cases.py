"""What processes started by tests/training/test_launch.py run (importable by name), and
how the tests of launched processes see one end."""

import torch


def threads() -> int:
    return torch.get_num_threads()


def surroundings(names: list[str]) -> dict:
    """What a launched process sees of its caller: the working directory, the given
    environment variables (None where unset), its rank from torchrun's agent, and whether
    torch came imported."""
    import os
    import sys

    return {
        "cwd": os.getcwd(),
        "env": {name: os.environ.get(name) for name in names},
        "rank": os.environ["RANK"],
        "torch_preloaded": "torch" in sys.modules,
    }


def speak(words: str) -> None:
    """Write ``words`` and the rank to stdout and to stderr, at the level of file descriptors
    as well as Python's streams."""
    import os
    import sys

    rank = os.environ["RANK"]
    print(f"{words} on stdout from rank {rank}", flush=True)
    print(f"{words} on stderr from rank {rank}", file=sys.stderr, flush=True)
    os.write(1, f"{words} written to fd 1 by rank {rank}\n".encode())


def unpicklable_result() -> object:
    return lambda: None  # a local function: pickled by name, and it has none


def wait_in_launch(folder: str, start_method: str) -> None:
    """A caller of ``gpipe.launch`` (the test signals or kills it): two processes that note
    their pids in ``folder`` and wait; the LaunchError it gets is written to ``folder/error``.
    Under ``"forkserver"`` they are children of a server that outlives the caller, not of
    the caller (whose end the kernel tells the children it forks)."""
    from pathlib import Path

    from gpipe import LaunchError, launch

    try:
        launch(note_pid_and_wait, 2, (folder,), threads=1, start_method=start_method)
    except LaunchError as exc:
        Path(folder, "error").write_text(str(exc))
        Path(folder, "signal").write_text(str(exc.signal))


def note_pid_and_wait(folder: str) -> None:
    """Write this process's pid to ``folder/pid-RANK``, then wait to be stopped (two minutes
    at most)."""
    import os
    import time
    from pathlib import Path

    Path(folder, f"pid-{os.environ['RANK']}.tmp").write_text(str(os.getpid()))
    os.replace(
        Path(folder, f"pid-{os.environ['RANK']}.tmp"), Path(folder, f"pid-{os.environ['RANK']}")
    )
    time.sleep(120)


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (reaped, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
