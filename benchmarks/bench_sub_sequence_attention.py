"""A sub-sequence's attention (``gpipe.runtime.sub_sequence_attention``) against causal
attention over the whole sequence and against the same attention under a mask: forward and
backward of one sequence cut into S sub-sequences, per S.

Contenders alternate within each cycle (order rotating); medians over the cycles, and each
contender's time over the whole sequence's in the same cycle.

    python -m benchmarks.bench_sub_sequence_attention                 # CPU, one thread
    python -m benchmarks.bench_sub_sequence_attention --device cuda   # bf16, 8192 tokens
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from gpipe.runtime.sub_sequence_attention import sub_sequence_attention

from .common import machine, summary, write_results


def _mask(past: int, new: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    hidden = (
        torch.arange(past + new, device=device)[None, :]
        > torch.arange(past, past + new, device=device)[:, None]
    )
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def _chunked(q: Tensor, k: Tensor, v: Tensor, s: int, masked: bool) -> None:
    c = q.shape[-2] // s
    qs, ks, vs = (t.split(c, dim=-2) for t in (q, k, v))
    for j in range(s):
        if masked and j:
            keys, values = k[..., : (j + 1) * c, :], v[..., : (j + 1) * c, :]
            mask = _mask(j * c, c, q.dtype, q.device)
            y = F.scaled_dot_product_attention(qs[j], keys, values, attn_mask=mask)
        else:
            y = sub_sequence_attention(
                qs[j],
                ks[j],
                vs[j],
                ks[:j],
                vs[:j],
                mask=lambda d, j=j: _mask(j * c, c, d, q.device),
            )
        y.sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    b, h, length, d, dtype = (
        (4, 16, 8192, 128, torch.bfloat16) if cuda else (1, 4, 2048, 32, torch.float32)
    )
    q, k, v = (
        torch.randn(b, h, length, d, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"
    )

    def whole() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    contenders = {"whole": whole}
    for s in (2, 4, 8):
        # merged on a CPU; on CUDA the lower-right causal bias
        contenders[f"S={s} merged"] = lambda s=s: _chunked(q, k, v, s, masked=False)
        contenders[f"S={s} masked"] = lambda s=s: _chunked(q, k, v, s, masked=True)
    names = list(contenders)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for cycle in range(args.repeats + 1):
        turn = cycle % len(names)
        for name in names[turn:] + names[:turn]:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            contenders[name]()
            if cuda:
                torch.cuda.synchronize()
            if cycle:
                seconds[name].append(time.perf_counter() - start)
    report: dict = {"machine": machine(), "shape": [b, h, length, d], "dtype": str(dtype), "ms": {}}
    for name in names:
        ratios = [a / w for a, w in zip(seconds[name], seconds["whole"], strict=True)]
        ms = summary([t * 1e3 for t in seconds[name]])
        report["ms"][name] = {"ms": ms, "over_whole_per_cycle": summary(ratios)}
        print(f"{name:12s} {ms['median']:8.2f} ms, over whole {summary(ratios)['median']:.3f}")
    print(f"written to {write_results(f'sub-sequence-attention-{device.type}', report)}")


if __name__ == "__main__":
    main()
