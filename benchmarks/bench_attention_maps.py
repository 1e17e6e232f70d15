"""The GPT block's attention with separate q, k and v maps (as tensor parallelism splits them
by whole heads) against one fused map of the same weights, side by side in one process.

Each cycle runs a forward and backward of one block with each variant, the order swapped every
cycle, and the ratio is taken within the cycle; the median of the ratios is reported.

    python -m benchmarks.bench_attention_maps                  # d_model 128 and 768
    python -m benchmarks.bench_attention_maps --cycles 15 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
from time import perf_counter

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe.models import Block, GPTConfig

from .common import machine

SHAPES = ((128, 4, 8, 128), (768, 12, 8, 256))  # d_model, heads, rows, tokens


class _FusedAttention(nn.Module):
    """The same attention with q, k and v in one map (the layout before the split)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        attn = block.attn
        self.head_dim, self.proj = attn.head_dim, attn.proj
        weight = torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]).detach()
        bias = torch.cat([attn.q.bias, attn.k.bias, attn.v.bias]).detach()
        self.qkv = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.qkv.weight.copy_(weight)
            self.qkv.bias.copy_(bias)

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        b, t, d = x.shape
        q, k, v = (
            part.view(b, t, -1, self.head_dim).transpose(1, 2)
            for part in self.qkv(x).split(d, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def _step(block: nn.Module, x: Tensor) -> float:
    start = perf_counter()
    block(x).sum().backward()
    return perf_counter() - start


def compare(d_model: int, heads: int, rows: int, tokens: int, cycles: int) -> list[float]:
    """Per cycle, separate maps' time over the fused map's."""
    torch.manual_seed(0)
    split = Block(GPTConfig(n_layer=4, d_model=d_model, n_head=heads, seq_len=tokens))
    fused = Block(GPTConfig(n_layer=4, d_model=d_model, n_head=heads, seq_len=tokens))
    fused.load_state_dict(split.state_dict())
    fused.attn = _FusedAttention(split)  # type: ignore[assignment]  # same weights, one map
    x = torch.randn(rows, tokens, d_model)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), split(x))
    blocks = {"split": split, "fused": fused}
    for block in blocks.values():  # warm-up
        _step(block, x)
    ratios = []
    for cycle in range(cycles):
        order = ["split", "fused"] if cycle % 2 == 0 else ["fused", "split"]
        took = {name: _step(blocks[name], x) for name in order}
        ratios.append(took["split"] / took["fused"])
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    for d_model, heads, rows, tokens in SHAPES:
        ratios = compare(d_model, heads, rows, tokens, args.cycles)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(
            f"d_model {d_model}, {rows} x {tokens} tokens: separate / fused maps, median of "
            f"{len(ratios)} cycles {statistics.median(ratios):.3f} (range {spread})"
        )


if __name__ == "__main__":
    main()
