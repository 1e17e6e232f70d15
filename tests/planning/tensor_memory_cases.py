"""What each process runs in tests/planning/test_tensor_share.py: the built-in GPT in a real
Pipeline(tensor_parallel=T) over gloo, one step and one AdamW step, and the bytes each rank
then holds in parameters, gradients and optimizer state."""

import torch
from torch.distributed.tensor import DTensor

from gpipe import Pipeline
from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss

CONFIG = GPTConfig(n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=32)
BALANCE = [3, 3]  # K = 2: embedding and two blocks, two blocks and the head
BATCH, CHUNKS = 4, 2


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def held_bytes(tensor_parallel: int) -> dict[str, int]:
    """This rank's parameters, gradients and AdamW state after one step, in bytes."""
    torch.manual_seed(0)
    pipe = Pipeline(
        build_gpt(CONFIG, device="meta"),
        BALANCE,
        chunks=CHUNKS,
        loss_fn=lm_loss,
        tensor_parallel=tensor_parallel,
    )
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.step(tokens if pipe.is_first else None, tokens if pipe.is_last else None)
    optimizer.step()
    params = list(pipe.parameters())
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {
        "params": sum(_bytes(p) for p in params),
        "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
        "states": sum(_bytes(t) for t in states),
        "stage": int(pipe.is_last),
    }
