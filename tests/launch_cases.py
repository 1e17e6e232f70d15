"""What processes started by tests/test_launch.py run (importable by name)."""

import torch


def threads() -> int:
    return torch.get_num_threads()
