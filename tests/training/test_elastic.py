"""Processes that torchrun's agent starts again meet on a store of their attempt's own: an
announcement an earlier attempt left in the agent's store is passed over."""

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

_WORKER = """
import torch, torch.distributed as dist
from gpipe.training.elastic import join_process_group
join_process_group(torch.device("cpu"), 10.0)
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(int(total.item()))
dist.destroy_process_group()
"""


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stale_announcement_is_passed_over_for_this_attempts_store():
    agent = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    agent.set("gpipe/attempt-store", f"{_dead_port()} left-by-a-lost-attempt")
    env = os.environ | {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-c", _WORKER]
    late = subprocess.Popen(command, env=env | {"RANK": "1"}, stdout=subprocess.PIPE, text=True)
    time.sleep(3)  # rank 1 reads the stale announcement first
    first = subprocess.run(
        command, env=env | {"RANK": "0"}, capture_output=True, text=True, timeout=60
    )
    out, _ = late.communicate(timeout=60)
    assert first.returncode == 0 and late.returncode == 0, first.stderr[-2000:]
    assert first.stdout.split() == out.split() == ["3"]
