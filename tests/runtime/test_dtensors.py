"""gpipe.runtime.dtensors: DTensors recognized without importing their module, and
``import gpipe`` (the CLI too) leaving that module unloaded."""

import subprocess
import sys

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gpipe.runtime.dtensors import dtensor_like, is_dtensor, local_part


def test_import_gpipe_and_its_cli_leave_torchs_dtensor_module_unloaded():
    code = (
        "import sys, gpipe, gpipe.cli, gpipe.cli.train, gpipe.cli.plan, gpipe.models.gpt\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.tensor')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_dtensor_its_local_part_and_one_laid_out_like_it(one_process_group):
    mesh = DeviceMesh("cpu", [0])
    whole = torch.arange(6.0).reshape(3, 2)
    split = distribute_tensor(whole, mesh, [Shard(0)])
    assert is_dtensor(split) and not is_dtensor(whole) and not is_dtensor(None)
    assert local_part(whole) is whole
    torch.testing.assert_close(local_part(split), whole)  # one rank holds every row
    again = dtensor_like(split, whole * 2)
    assert isinstance(again, DTensor) and again.placements == (Shard(0),)
    torch.testing.assert_close(again.to_local(), whole * 2)
    plain = whole * 2
    assert dtensor_like(whole, plain) is plain
