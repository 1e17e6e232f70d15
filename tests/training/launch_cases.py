"""What processes started by tests/training/test_launch.py run (importable by name)."""

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
