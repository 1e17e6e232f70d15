"""The GPUs a cluster plan can be for: each device's datasheet figures, and a user's own
devices read from a TOML file.

Figures are as the vendors' datasheets give them (docs/planning.md cites each): dense
bf16/fp16 tensor FLOP/s (without sparsity), memory and its bandwidth, GPUs per node and the
per-GPU bandwidth of the link within a node (NVLink, Infinity Fabric or PCIe, both directions
together, as datasheets quote it) and between nodes (the NIC's line rate per GPU, one
direction). ``gemm_efficiency`` is not a datasheet figure but the model's calibration: the
fraction of the dense peak that large bf16 matrix products sustain in training. ``stack``
is the software a device's published runs used by default (``layer_costs.STACKS``): the
A100's were Megatron-LM's of 2021-22, the later devices' Megatron-Core's.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["CATALOGUE", "Cluster", "Device", "load_devices", "parse_cluster"]


@dataclass(frozen=True)
class Device:
    """One GPU model as a plan sees it (units as datasheets print them)."""

    name: str
    peak_tflops: float  # dense bf16/fp16 tensor TFLOP/s
    memory_gib: float  # device memory
    memory_tbps: float  # its bandwidth, TB/s
    gpus_per_node: int
    intra_node_gbs: float  # GB/s per GPU within a node, both directions together
    inter_node_gbits: float  # Gb/s per GPU between nodes, one direction
    gemm_efficiency: float  # sustained fraction of the peak by large matrix products
    latency_us: float = 5.0  # a collective step's or a message's fixed cost between nodes
    stack: str = "megatron-core"  # the software its published runs used (layer_costs.STACKS)

    def __post_init__(self) -> None:
        if self.stack not in _STACKS:
            raise ValueError(
                f"device {self.name!r}: stack must be one of {list(_STACKS)}, got {self.stack!r}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "stack"):
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"device {self.name!r}: {f.name} must be a positive number, got {value!r}"
                )
        if self.gemm_efficiency > 1:
            raise ValueError(
                f"device {self.name!r}: gemm_efficiency is a fraction of the peak, at most 1, "
                f"got {self.gemm_efficiency}"
            )
        if not isinstance(self.gpus_per_node, int):
            raise ValueError(
                f"device {self.name!r}: gpus_per_node must be a whole number, "
                f"got {self.gpus_per_node!r}"
            )

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def hbm_bandwidth(self) -> float:
        """Bytes per second of device memory."""
        return self.memory_tbps * 1e12

    @property
    def intra_node_bandwidth(self) -> float:
        """Bytes per second one GPU sends to the others of its node (one direction)."""
        return self.intra_node_gbs * 1e9 / 2

    @property
    def inter_node_bandwidth(self) -> float:
        """Bytes per second one GPU sends out of its node."""
        return self.inter_node_gbits * 1e9 / 8


_STACKS = ("megatron-2021", "megatron-core")


def _nvidia(
    name: str,
    tflops: float,
    gib: float,
    tbps: float,
    nvlink: float,
    nic: float,
    gemm: float,
    stack: str = "megatron-core",
) -> Device:
    """An NVIDIA part in its reference system (DGX or HGX): eight GPUs to a node."""
    return Device(name, tflops, gib, tbps, 8, nvlink, nic, gemm, stack=stack)


# Datasheet figures (docs/planning.md, "The catalogue", cites each); gemm_efficiency is the
# calibration that docs/planning.md states with its sources.
CATALOGUE: dict[str, Device] = {
    d.name: d
    for d in (
        _nvidia("A100-40GB", 312, 40, 1.555, 600, 200, 0.72, "megatron-2021"),
        _nvidia("A100-80GB", 312, 80, 2.039, 600, 200, 0.72, "megatron-2021"),
        _nvidia("H100-SXM", 989, 80, 3.35, 900, 400, 0.60),
        _nvidia("H100-PCIe", 756, 80, 2.0, 128, 200, 0.60),
        _nvidia("H200", 989, 141, 4.8, 900, 400, 0.60),
        _nvidia("B200", 2250, 180, 8.0, 1800, 400, 0.60),
        Device("MI300X", 1307.4, 192, 5.3, 8, 896, 400, 0.45),
    )
}

_KEYS = [f.name for f in fields(Device) if f.name != "name"]
_REQUIRED = [f.name for f in fields(Device) if f.name not in ("name", "latency_us", "stack")]


def load_devices(path: str | Path) -> dict[str, Device]:
    """A user's devices from a TOML file: one table per device under ``[devices]``, its keys
    those of ``Device`` (``latency_us`` optional), e.g.::

        [devices.L40S]
        peak_tflops = 362
        memory_gib = 48
        ...

    A bad entry raises ValueError naming the file, the device and the key.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--devices {path}: {exc}") from None
    tables = data.get("devices")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"--devices {path}: expected [devices.NAME] tables, found none")
    return {name: _device(path, name, entry) for name, entry in tables.items()}


def _device(path: str | Path, name: str, entry: Any) -> Device:
    if not isinstance(entry, dict):
        raise ValueError(f"--devices {path}: devices.{name} must be a table of figures")
    unknown = sorted(set(entry) - set(_KEYS))
    missing = [k for k in _REQUIRED if k not in entry]
    if unknown or missing:
        what = [
            f"unknown keys {unknown}" if unknown else "",
            f"missing {missing}" if missing else "",
        ]
        raise ValueError(
            f"--devices {path}: devices.{name}: {'; '.join(w for w in what if w)} "
            f"(the keys are {_KEYS})"
        )
    try:
        return Device(name, **entry)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--devices {path}: {exc}") from None


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices of one kind, ``device.gpus_per_node`` to a node."""

    gpus: int
    device: Device

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.device.gpus_per_node)

    def __str__(self) -> str:
        return f"{self.gpus}x{self.device.name}"


def parse_cluster(text: str, extra: dict[str, Device] | None = None) -> Cluster:
    """``3072xA100-80GB``: the GPU count and a device of the catalogue (or of ``extra``);
    an unknown device's error lists the known ones."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\S+)\s*", text)
    if match is None:
        raise ValueError(f"--cluster must be NxDEVICE such as 3072xA100-80GB, got {text!r}")
    known = {**CATALOGUE, **(extra or {})}
    gpus, name = int(match.group(1)), match.group(2)
    device = known.get(name) or next(
        (d for n, d in known.items() if n.lower() == name.lower()), None
    )
    if device is None:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(known)}")
    if gpus < 1:
        raise ValueError(f"--cluster needs at least one GPU, got {gpus}")
    return Cluster(gpus, device)
