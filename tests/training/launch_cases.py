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
