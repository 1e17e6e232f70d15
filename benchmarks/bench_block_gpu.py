"""The cluster planner's block model against one real GPU: a Megatron-style GPT block, cut as
one GPU of a tensor-parallel group holds it, timed forward and backward in bf16, beside what
``gpipe.planning.layer_costs.block_costs`` predicts for the same shape on the catalogue's
entry for this GPU (the collectives left out: one GPU has none to run).

The shapes are those of Megatron-Core's weak-scaling rows on H100 (sequence 4,096, micro-batch
1, the row's tensor-parallel width T): each GPU's QKV, attention output and MLP products take
1/T of the widths, the norms and residual adds the whole hidden size (no sequence
parallelism), attention runs PyTorch's fused kernel (``scaled_dot_product_attention``,
causal), hidden dropout 0.1. Each pass is the median of ``--repeats`` timings with CUDA
events after warm-up; the backward is the forward-and-backward less the forward. Then the
matrix products alone: the block's four products at the row's widths, TFLOP/s measured beside
the roofline's (``matmul_seconds``). The ratio measured / predicted per shape is what the
planner's single calibration constant stands for: if it is flat across shapes, the roofline's
shape dependence holds on this GPU, whatever its level. Needs one CUDA device::

    PYTHONPATH=src python -m benchmarks.bench_block_gpu --json block_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from gpipe.planning import (
    CATALOGUE,
    Device,
    Link,
    Software,
    Work,
    block_costs,
    gpt_shape,
    matmul_seconds,
)

# Megatron-Core's rows: size, (layers, hidden, heads), tensor-parallel width
ROWS = [
    ("1.7B", (24, 2048, 16), 1),
    ("7.1B", (30, 4096, 32), 2),
    ("16B", (32, 6144, 48), 4),
    ("32B", (48, 7168, 56), 8),
    ("70B", (84, 8192, 64), 8),
    ("177B", (96, 12288, 96), 8),
    ("462B", (112, 18432, 144), 8),
]
SEQ = 4096
NO_LINK = Link(bandwidth=float("inf"), latency=0.0)
ONE_GPU = Software("flash", sequence_parallel=False, tp_overlap=False, p2p_overlap=False)


class SlicedBlock(nn.Module):
    """One GPU's share of a tensor-parallel GPT block (its collectives left out)."""

    def __init__(self, hidden: int, heads: int, t: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads // t, hidden // heads
        width = self.heads * self.head_dim
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * width)
        self.out = nn.Linear(width, hidden)
        self.up = nn.Linear(hidden, 4 * hidden // t)
        self.down = nn.Linear(4 * hidden // t, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.out(attended.transpose(1, 2).reshape(b, s, -1)), 0.1)
        return x + F.dropout(self.down(F.gelu(self.up(self.norm2(x)))), 0.1)


def _median_ms(run, repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_block(hidden: int, heads: int, t: int, repeats: int) -> tuple[float, float]:
    """Milliseconds of the forward and of the backward of one micro-batch."""
    block = SlicedBlock(hidden, heads, t).cuda().to(torch.bfloat16)
    x = torch.randn(1, SEQ, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    forward = _median_ms(lambda: block(x), repeats)
    both = _median_ms(lambda: block(x).backward(grad), repeats)
    return forward, both - forward


def predict_block(
    device: Device, layers: int, hidden: int, heads: int, t: int
) -> tuple[float, float]:
    """Milliseconds ``block_costs`` predicts for the same forward and backward (input and
    weight gradients), the collectives left out."""
    work = Work(device, t, 1, SEQ, NO_LINK, "none", ONE_GPU)
    costs = block_costs(gpt_shape(layers, hidden, heads, 131072), work)
    return 1e3 * costs.forward, 1e3 * (costs.backward + costs.weight)


def measure_gemm(m: int, n: int, k: int, repeats: int) -> float:
    """Milliseconds of one bf16 product of ``m x k`` by ``k x n``."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return _median_ms(lambda: a @ b, repeats)


def catalogue_entry() -> Device:
    name = torch.cuda.get_device_name(0)
    if "H200" in name:
        return CATALOGUE["H200"]
    if "H100" in name:
        return CATALOGUE["H100-PCIe" if "PCIe" in name else "H100-SXM"]
    if "A100" in name:
        return CATALOGUE["A100-80GB" if "80GB" in name else "A100-40GB"]
    raise SystemExit(f"no catalogue entry for {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    device = catalogue_entry()
    found = {
        "gpu": torch.cuda.get_device_name(0),
        "catalogue": device.name,
        "torch": torch.__version__,
    }
    blocks, gemms = [], []
    print(
        f"{'row':>6} {'T':>2} {'fwd ms':>8} {'pred':>8} {'ratio':>6} "
        f"{'bwd ms':>8} {'pred':>8} {'ratio':>6}"
    )
    for size, (layers, hidden, heads), t in ROWS:
        forward, backward = measure_block(hidden, heads, t, args.repeats)
        pf, pb = predict_block(device, layers, hidden, heads, t)
        blocks.append(
            {
                "row": size,
                "hidden": hidden,
                "heads": heads,
                "t": t,
                "forward_ms": forward,
                "backward_ms": backward,
                "predicted_forward_ms": pf,
                "predicted_backward_ms": pb,
            }
        )
        print(
            f"{size:>6} {t:>2} {forward:8.3f} {pf:8.3f} {forward / pf:6.3f} "
            f"{backward:8.3f} {pb:8.3f} {backward / pb:6.3f}",
            flush=True,
        )
        width = hidden // t
        for n, k in (
            (3 * width, hidden),
            (hidden, width),
            (4 * width, hidden),
            (hidden, 4 * width),
        ):
            ms = measure_gemm(SEQ, n, k, args.repeats)
            predicted = 1e3 * matmul_seconds(device, SEQ, n, k)
            gemms.append(
                {
                    "row": size,
                    "m": SEQ,
                    "n": n,
                    "k": k,
                    "ms": ms,
                    "predicted_ms": predicted,
                    "tflops": 2 * SEQ * n * k / ms / 1e9,
                }
            )
        torch.cuda.empty_cache()
    print(f"{'row':>6} {'m':>5} {'n':>6} {'k':>6} {'TFLOP/s':>8} {'measured/predicted':>19}")
    for g in gemms:
        print(
            f"{g['row']:>6} {g['m']:5d} {g['n']:6d} {g['k']:6d} {g['tflops']:8.1f} "
            f"{g['ms'] / g['predicted_ms']:19.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**found, "seq_len": SEQ, "blocks": blocks, "gemms": gemms}, f, indent=1)


if __name__ == "__main__":
    main()
