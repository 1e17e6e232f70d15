"""The data a script feeds a pipeline: text with no download and its random windows
(``text``), and sequences of different lengths packed into token-balanced micro-batches
(``packing``), with the check a packed micro-batch passes before it is sent."""

from gpipe.data.packing import IGNORE_INDEX, Plan, counts_of, pack, plan, spread
from gpipe.data.text import (
    BatchSampler,
    ByteDataset,
    decode,
    encode,
    load_text,
    stdlib_corpus,
)
from gpipe.runtime.packed_check import check_packed

__all__ = [
    "BatchSampler",
    "ByteDataset",
    "IGNORE_INDEX",
    "Plan",
    "check_packed",
    "counts_of",
    "decode",
    "encode",
    "load_text",
    "pack",
    "plan",
    "spread",
    "stdlib_corpus",
]
