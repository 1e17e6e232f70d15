"""What one micro-batch costs one GPU of a tensor-parallel group, layer by layer: the
seconds of its forward, backward (input and weight gradients apart) and recomputation, the
tensor-parallel collectives among them, and the activation bytes it keeps.

A block is counted kernel by kernel as Megatron-LM runs it (Narayanan et al. 2021; Korthikanti
et al. 2022, arXiv:2205.05198): four matrix products split over the T GPUs (QKV, attention
output, MLP up, MLP down; each backward a product for the input gradient and one for the
weight gradient), the attention core, the memory-bound kernels (two norms, the activation,
bias-dropout-residual adds, softmax), and per pass two all-reduces of the block's output
over the group (with sequence parallelism, an all-gather and a reduce-scatter each, the same
traffic; the norms and adds then run on 1/T of the tokens). A block with experts runs a
router, the shared experts' MLP and each expert's MLP on the tokens routed to it (as many as
each would get under balanced routing), every expert's matrices split over the T GPUs as a
dense MLP's are; no expert parallelism, as gpipe has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpipe.planning.hardware import Device
from gpipe.planning.roofline import Link, flash_seconds, matmul_seconds, stream_seconds
from gpipe.planning.transformer import TransformerShape

__all__ = [
    "RECOMPUTE",
    "STACKS",
    "PassCosts",
    "Software",
    "Work",
    "attention_costs",
    "block_costs",
    "embedding_costs",
    "head_costs",
]

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "unfused")


@dataclass(frozen=True)
class Software:
    """How the kernels and collectives run: ``attention`` fused (``flash``, FlashAttention:
    no score matrix in memory, masked blocks skipped) or ``unfused`` (batched products around
    a fused softmax, as Megatron-LM ran it in 2021-22); ``sequence_parallel`` shards the
    norms, adds and dropout along the sequence over the T GPUs; ``tp_overlap`` hides the
    tensor-parallel collectives behind the products they feed, as far as those last (at
    ``TP_OVERLAP_COST`` of the hidden time, for the compute they share); ``p2p_overlap``
    sends the pipeline's messages beside the compute, where without it a send holds its
    stage until the message is through (NCCL's send on the compute stream)."""

    attention: str = "flash"
    sequence_parallel: bool = True
    tp_overlap: bool = True
    p2p_overlap: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")


# The two software stacks published runs used: Megatron-LM as in its 2021-22 papers (and the
# BLOOM and MT-NLG runs built on it), and Megatron-Core with Transformer Engine since 2023.
STACKS = {
    "megatron-2021": Software(
        "unfused", sequence_parallel=False, tp_overlap=False, p2p_overlap=False
    ),
    "megatron-core": Software("flash", sequence_parallel=True, tp_overlap=True, p2p_overlap=True),
}
TP_OVERLAP_COST = 0.2


@dataclass(frozen=True)
class Work:
    """One micro-batch's shape on one GPU: ``micro_batch`` sequences of ``seq_len`` tokens,
    tensor parallel over ``tensor_parallel`` GPUs joined by ``link``."""

    device: Device
    tensor_parallel: int
    micro_batch: int
    seq_len: int
    link: Link
    recompute: str = "none"
    software: Software = Software()

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute must be one of {RECOMPUTE}, got {self.recompute!r}")

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    def all_reduce(self, nbytes: float) -> float:
        return self.link.ring(nbytes, self.tensor_parallel, passes=2)

    def exposed(self, comm: float, products: float) -> float:
        """What of ``comm`` seconds of collectives the pass waits for, beside ``products``
        seconds of the matrix products they could hide behind."""
        if not self.software.tp_overlap:
            return comm
        hidden = min(comm, products)
        return comm - hidden + TP_OVERLAP_COST * hidden

    @property
    def replicated(self) -> float:
        """The share of the tokens each GPU's norms and adds see."""
        return 1 / self.tensor_parallel if self.software.sequence_parallel else 1.0


@dataclass(frozen=True)
class PassCosts:
    """Seconds of a micro-batch's ``forward``, ``backward`` (input gradients), ``weight``
    (weight gradients) and ``recompute`` (the forward redone before the backward), of which
    ``tp_comm`` are collectives; ``stored`` bytes kept from its forward to its backward, and
    ``working`` bytes more while its backward runs."""

    forward: float = 0.0
    backward: float = 0.0
    weight: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    stored: float = 0.0
    working: float = 0.0

    def __add__(self, other: PassCosts) -> PassCosts:
        """Two layers one after the other: one layer's backward runs at a time, so their
        working sets do not add up."""
        return PassCosts(
            self.forward + other.forward,
            self.backward + other.backward,
            self.weight + other.weight,
            self.recompute + other.recompute,
            self.tp_comm + other.tp_comm,
            self.stored + other.stored,
            max(self.working, other.working),
        )

    def times(self, n: int) -> PassCosts:
        """``n`` such layers one after another."""
        if n == 0:
            return PassCosts()
        return PassCosts(
            self.forward * n,
            self.backward * n,
            self.weight * n,
            self.recompute * n,
            self.tp_comm * n,
            self.stored * n,
            self.working,
        )


def _products(shape: TransformerShape, t: int, moe: bool) -> list[tuple[float, int, int, int]]:
    """The block's matrix products on one GPU of t, each as (share of the micro-batch's
    tokens it takes, in width, out width, how many): QKV, the attention output, and the
    MLP's up and down; with experts, the router (whole on each GPU), the shared experts'
    MLP, and each expert's on its share of the tokens (routing taken as balanced)."""
    attention = [
        (1.0, i // t if split == "in" else i, o // t if split == "out" else o, 1)
        for i, o, split in shape.attention_products()
    ]

    def mlp(width: int, share: float = 1.0, count: int = 1) -> list[tuple[float, int, int, int]]:
        up = (2 if shape.gated else 1) * width
        return [(share, shape.hidden, up // t, count), (share, width // t, shape.hidden, count)]

    if not moe:
        return attention + mlp(shape.ffn)
    router = [(1.0, shape.hidden, shape.experts, 1)]
    shared = mlp(shape.shared_ffn) if shape.shared_ffn else []
    share = shape.experts_per_token / shape.experts
    return attention + router + shared + mlp(shape.expert_ffn, share, shape.experts)


def attention_costs(
    shape: TransformerShape, work: Work, window: int | None = None
) -> tuple[float, float, float, float]:
    """The attention core's forward and backward seconds, its stored bytes per micro-batch,
    and (unfused) the bytes of the score matrices among them. FlashAttention skips the
    blocks a causal mask or a ``window`` hides; the unfused products compute the whole
    square and the softmax masks it, window or not."""
    d, s, b = work.device, work.seq_len, work.micro_batch
    heads = shape.heads / work.tensor_parallel
    qk, v = shape.head_dim, shape.v_width // shape.heads  # numbers a head multiplies
    if work.software.attention == "flash":
        if window is None or window >= s:
            executed = 2.0 * b * heads * s * s * (qk + v) * min(1.0, 0.5 + 64 / s)  # causal
        else:  # the band's pairs, and the blocks its edge cuts, computed whole
            keys = min(float(s), shape.causal_pairs(s, window) / s + 64)
            executed = 2.0 * b * heads * s * keys * (qk + v)
        forward = flash_seconds(d, executed)
        backward = flash_seconds(d, 2.5 * executed, backward=True)
        return forward, backward, 4.0 * b * heads * s, 0.0  # the softmax's log-sum-exp
    pairs = b * heads
    scores = pairs * s * s  # elements of one score matrix per head
    drop = 1.0 if shape.dropout else 0.0
    products = matmul_seconds(d, s, s, qk, pairs) + matmul_seconds(d, s, v, s, pairs)
    # scale-mask-softmax reads and writes the scores; dropout reads, writes and masks them
    forward = products + stream_seconds(d, (4 + 5 * drop) * scores)
    backward = 2 * products + stream_seconds(d, (6 + 5 * drop) * scores)
    kept = (2 + 3 * drop) * scores  # softmax output, dropout mask and output
    return forward, backward, kept, kept


def block_costs(
    shape: TransformerShape, work: Work, moe: bool = False, window: int | None = None
) -> PassCosts:
    """One transformer block's costs for one micro-batch on one GPU of the group: a dense
    block's, or (``moe``) one whose MLP is the shape's experts; its attention over the whole
    prefix, or a ``window``."""
    d, t, n = work.device, work.tensor_parallel, work.tokens
    h, drop = shape.hidden, (1.0 if shape.dropout else 0.0)
    products = [(n * share, i, o, c) for share, i, o, c in _products(shape, t, moe)]
    gemm_f = sum(matmul_seconds(d, m, o, i, c) for m, i, o, c in products)
    gemm_input = sum(matmul_seconds(d, m, i, o, c) for m, i, o, c in products)
    gemm_weight = sum(matmul_seconds(d, i, o, m, c) for m, i, o, c in products)
    attn_f, attn_b, attn_kept, scores = attention_costs(shape, work, window)
    # per token, 16-bit: two norms (read, write), two residual adds with bias and dropout
    # (read two, write one, a mask), the MLP's activation (gated: reads two); with experts,
    # each token's copies sent to its experts and their outputs summed back (read, write)
    rows = n * work.replicated
    width = shape.experts_per_token * shape.expert_ffn + shape.shared_ffn if moe else shape.ffn
    act = (3 if shape.gated else 2) * 2 * width / t
    routed = 8.0 * shape.experts_per_token * h if moe else 0.0
    elementwise = rows * (8 + 2 * (6 + drop)) * h + n * (act + routed)
    comm = 2 * work.all_reduce(2.0 * n * h) if t > 1 else 0.0
    comm_f, comm_b = work.exposed(comm, gemm_f), work.exposed(comm, gemm_input)
    forward = gemm_f + attn_f + stream_seconds(d, elementwise) + comm_f
    backward = gemm_input + attn_b + stream_seconds(d, 2 * elementwise) + comm_b
    # kept per token (Korthikanti et al.): norm inputs and outputs feeding the products,
    # dropout masks (replicated unless sequence parallel), Q, K, V, the attention output and
    # the MLP's activation input and output (split over T); with experts, the token's copies
    # that their products read and the router's fp32 probabilities
    replicated = rows * (8 + 2 * drop) * h
    attention_split, latents = shape.attention_kept_widths()
    replicated += n * 2 * latents  # from the whole input, on every GPU of T
    split = n * (2 * attention_split / t + act + 2 * width / t)
    if moe:
        split += n * (2.0 * shape.experts_per_token * h + 4.0 * shape.experts)
    full = replicated + split + attn_kept
    if work.recompute == "full":
        stored, again = 2.0 * h * rows, forward
    elif work.recompute == "selective" and scores:
        stored, again = full - scores, attn_f
    else:
        stored, again = full, 0.0
    return PassCosts(
        forward=forward,
        backward=backward,
        weight=gemm_weight,
        recompute=again,
        tp_comm=(2 if work.recompute == "full" else 1) * comm_f + comm_b,
        stored=stored,
        working=full - stored,
    )


def embedding_costs(shape: TransformerShape, work: Work) -> PassCosts:
    """The embedding lookup (vocabulary split over T: its output all-reduced) and the
    scatter of its gradient."""
    n, h = work.tokens, shape.hidden
    comm = work.all_reduce(2.0 * n * h) if work.tensor_parallel > 1 else 0.0
    lookup = stream_seconds(work.device, 4.0 * n * h)
    return PassCosts(forward=lookup + comm, weight=2 * lookup, tp_comm=comm)


def head_costs(shape: TransformerShape, work: Work) -> PassCosts:
    """The final norm, the logits (vocabulary split over T) and the cross-entropy in fp32;
    the logits are never recomputed (Megatron's equation 3 counts them three times)."""
    d, t, n, h = work.device, work.tensor_parallel, work.tokens, shape.hidden
    v = shape.vocab / t
    norm = stream_seconds(d, 4.0 * n * h * work.replicated)
    loss = stream_seconds(d, 12.0 * n * v)  # logits to fp32, softmax, its gradient
    comm = work.all_reduce(2.0 * n * h) if t > 1 else 0.0  # the input's gradient
    return PassCosts(
        forward=matmul_seconds(d, n, v, h) + norm + loss,
        backward=matmul_seconds(d, n, h, v) + 2 * norm + loss + comm,
        weight=matmul_seconds(d, h, v, n),
        tp_comm=comm,
        stored=2.0 * n * h,
        working=10.0 * n * v,  # logits in 16-bit, their fp32 softmax and its gradient
    )
