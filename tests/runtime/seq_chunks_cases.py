"""What the processes of tests/runtime/test_seq_chunks.py run (importable by name)."""

import copy

import torch

from gpipe import Pipeline
from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss

EXACT = {"rtol": 1e-10, "atol": 1e-12}


def _gpt() -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=3, d_model=32, n_head=4, seq_len=24, vocab_size=64)
    model = build_gpt(config).double()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 7, 24), generator=generator)  # 7 rows: uneven micro-batches
    return model, x, y


def gpt_against_unsplit(schedule: str, checkpoint: str, seq_chunks: int, split: str) -> int:
    """Two SGD steps of the GPT with sequence-pipelined micro-batches, in float64: the loss,
    every gradient and the updated weights equal those of un-pipelined training on the whole
    batch. Returns the number of steps compared."""
    reference, x, y = _gpt()
    pipe = Pipeline(
        copy.deepcopy(reference),
        [2, 3],
        chunks=3,
        schedule=schedule,
        checkpoint=checkpoint,
        loss_fn=lm_loss,
        seq_chunks=seq_chunks,
        seq_split=split,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        length = 24 - 4 * step  # a second sequence length too
        inputs, targets = x[:, :length], y[:, :length]
        reference.zero_grad()
        expected = lm_loss(reference(inputs), targets)
        expected.backward()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        pipe.zero_grad()
        loss = pipe.step(inputs, targets)
        torch.testing.assert_close(loss, expected.detach(), **EXACT)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], **EXACT, msg=name)
        optimizer.step()
        ref_optimizer.step()
    return 2
