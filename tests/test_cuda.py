"""The same promise on CUDA devices: GPipe across GPUs, Pipeline over NCCL. Skipped without
CUDA (CI has none); run them on a GPU machine with
`GPIPE_TEST_CUDA=1 pytest tests/test_cuda.py` (without it the suite hides the GPUs and runs
on CPU: tests/conftest.py)."""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy, mse_loss

from gpipe import GPipe, Pipeline, launch

from . import distributed_cases as cases
from .small_models import VOCAB, batch, mlp, tied, tokens

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device and GPIPE_TEST_CUDA=1")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices and GPIPE_TEST_CUDA=1")


@needs_gpu
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_gpipe_on_cuda_matches_unpipelined(mode):
    devices = [f"cuda:{i % GPUS}" for i in range(2)]
    reference = mlp().cuda()
    pipe = GPipe(copy.deepcopy(reference), [4, 4], devices=devices, chunks=4, checkpoint=mode)
    x, y = (t.cuda() for t in batch(10))
    mse_loss(pipe(x), y.to(devices[-1])).backward()
    mse_loss(reference(x), y).backward()
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.cuda(), ref[name.split(".", 2)[2]].grad)


@needs_two_gpus
def test_pipeline_over_nccl_matches_unpipelined():
    results = launch(cases.equivalence_cuda, 2)
    assert all(r == "ok" for r in results.values())


@needs_two_gpus
@pytest.mark.parametrize("mode", ["never", "always"])
def test_gpipe_copies_between_gpus_on_copy_streams(mode):
    """Activations and gradients cross GPUs on each device's copy stream, and every step
    still equals the unpipelined one (a copy read before it is written, or memory reused
    while a copy reads it, would show as wrong gradients)."""
    reference = mlp().cuda(0)
    pipe = GPipe(
        copy.deepcopy(reference), [4, 4], devices=["cuda:0", "cuda:1"], chunks=8, checkpoint=mode
    )
    for step in range(3):
        x, y = (t.cuda(0) for t in batch(64, seed=step))
        pipe.zero_grad()
        reference.zero_grad()
        mse_loss(pipe(x), y.cuda(1)).backward()
        mse_loss(reference(x), y).backward()
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad.cuda(0), ref[name.split(".", 2)[2]].grad)
    assert pipe.workers.copies.devices == {torch.device("cuda", 0), torch.device("cuda", 1)}


@pytest.fixture(scope="module")
def world_of_one():
    """This process as a world of one rank, for a Pipeline whose stages all live on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(port)
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class _Busy(torch.autograd.Function):
    """The identity, after a matrix product whose result is dropped, in the forward and in
    the backward: work queued on a stream ahead of a tensor that another stream will read."""

    @staticmethod
    def forward(ctx, x, scratch):
        ctx.save_for_backward(scratch)
        with torch.no_grad():
            scratch @ scratch
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (scratch,) = ctx.saved_tensors
        scratch @ scratch
        return grad, None


class Busy(nn.Module):
    """Milliseconds of GPU work that change nothing, so that a stream which reads a stage's
    output or gradient without waiting for it reads it before it is written."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scratch", torch.randn(4096, 4096))

    def forward(self, x):
        return _Busy.apply(x, self.scratch)


def wide_mlp(seed: int = 0) -> nn.Sequential:
    """[Busy, 4 layers | 5 layers, Busy]: each stage's hand-over comes after work queued
    ahead of it, in the forward (stage 0) and in the backward (stage 1)."""
    torch.manual_seed(seed)
    block = [nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Tanh()]
    again = [nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Tanh()]
    layers = [Busy(), *block, *again, nn.Linear(256, 256), Busy()]
    return nn.Sequential(*layers).double()


@needs_gpu
@pytest.mark.parametrize(
    "schedule, overlap",
    [("dualpipe-v", None), ("zero-bubble-v", True), ("v-half", True), ("1f1b", True)],
)
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_stage_streams_match_unpipelined(world_of_one, schedule, overlap, mode):
    """Each stage's work on its own CUDA stream (dualpipe-v's default): three optimizer steps
    over uneven micro-batches equal un-pipelined training in float64."""
    model = wide_mlp()
    reference = copy.deepcopy(model).cuda()
    balance = [11] if schedule == "1f1b" else [5, 6]
    pipe = Pipeline(
        model,
        balance,
        chunks=8,
        checkpoint=mode,
        schedule=schedule,
        loss_fn=mse_loss,
        device="cuda",
        overlap_stages=overlap,
    )
    assert pipe.runner.streams is not None
    assert set(pipe.runner.streams.stages) == set(pipe.stages)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8 * 96 - 5, 256, dtype=torch.float64, generator=g).cuda()
        y = torch.randn(8 * 96 - 5, 256, dtype=torch.float64, generator=g).cuda()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        loss = pipe.step(x, y)
        ref_loss = mse_loss(reference(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-12, atol=0)
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-10, atol=1e-14)
        optimizer.step()
        ref_optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=1e-10, atol=1e-14)


@needs_gpu
def test_stage_streams_with_a_weight_tied_across_the_v(world_of_one):
    """The V's first and last stage share the process and a tied weight: the gradient that
    both streams add to is the sum of both uses."""
    reference = tied().cuda()
    pipe = Pipeline(
        tied(), [2, 2], chunks=4, schedule="dualpipe-v", loss_fn=cross_entropy_of, device="cuda"
    )
    assert pipe.runner.streams is not None
    for step in range(2):
        x, y = (t.cuda() for t in tokens(7, seed=step))
        pipe.zero_grad()
        reference.zero_grad()
        loss = pipe.step(x, y)
        ref_loss = cross_entropy_of(reference(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss.double(), ref_loss.detach())
        # each copy of the tied weight holds the sum of both uses' gradients
        ref = dict(reference.named_parameters(remove_duplicate=False))
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad)


def cross_entropy_of(logits, targets):
    return cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@needs_gpu
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("split", ["even", "balanced"])
def test_sub_sequences_on_cuda_match_unpipelined(world_of_one, schedule, split):
    """seq_chunks=4 on one GPU: the GPT's attention on a sub-sequence takes PyTorch's
    lower-right causal bias there; the loss and gradients of the whole sequence, float32."""
    from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss

    torch.manual_seed(0)
    model = build_gpt(GPTConfig(n_layer=3, d_model=64, n_head=4, seq_len=256, vocab_size=128))
    reference = copy.deepcopy(model).cuda()
    pipe = Pipeline(
        model,
        [5],
        chunks=4,
        schedule=schedule,
        loss_fn=lm_loss,
        device="cuda",
        seq_chunks=4,
        seq_split=split,
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 257), generator=g).cuda()
    x, y = ids[:, :-1], ids[:, 1:]
    loss = pipe.step(x, y)
    ref_loss = lm_loss(reference(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6)


@needs_gpu
def test_padded_sub_sequences_on_cuda_weigh_their_counted_tokens(world_of_one):
    """seq_chunks=4 with right-padded targets and counts per token on one GPU: the last
    sub-sequence of every row is padding (weight 0, its loss a zero on the GPU), and the
    step equals the unsplit one, float32."""
    from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss

    torch.manual_seed(0)
    model = build_gpt(GPTConfig(n_layer=3, d_model=64, n_head=4, seq_len=256, vocab_size=128))
    reference = copy.deepcopy(model).cuda()
    options = {"chunks": 4, "loss_fn": lm_loss, "device": "cuda", "seq_chunks": 4}
    pipe = Pipeline(model, [5], schedule="zero-bubble", **options)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 257), generator=g).cuda()
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[:, 150:] = -100
    y[3, 20:] = -100
    loss = pipe.step(x, y, counts=y != -100)
    ref_loss = lm_loss(reference(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_generation_on_cuda_equals_the_gpts_own_sampler(world_of_one, prefill_chunk):
    """Pipeline.generate on one GPU, greedy, float32: the tokens of the GPT's own sampler run
    on the same GPU, prompts of different lengths, one and two groups in flight."""
    from .engine import generation_cases as gen

    want = gen.gpt_greedy(device="cuda")
    pipe = Pipeline(gen.gpt_model(), chunks=1, device="cuda")
    for in_flight in (None, 2):
        got = pipe.generate(
            gen.prompts(64), gen.NEW, in_flight=in_flight, prefill_chunk=prefill_chunk
        )
        assert got == want, (in_flight, got, want)


@needs_gpu
def test_seeded_sampling_on_cuda_is_the_same_whatever_the_groups_in_flight(world_of_one):
    from .engine import generation_cases as gen

    pipe = Pipeline(gen.gpt_model(), chunks=1, device="cuda")
    found = [
        pipe.generate(gen.prompts(64), gen.NEW, in_flight=n, prefill_chunk=5, **gen.SAMPLING)
        for n in (1, 2, 3)
    ]
    assert found[0] == found[1] == found[2]
    assert found[0] != gen.gpt_greedy()


@needs_gpu
def test_llama_generation_on_cuda_equals_hugging_faces(world_of_one):
    """Llama cut by its plan into one stage on the GPU, the model's own cache class in it:
    the tokens of Hugging Face's ``generate(do_sample=False)`` on the same GPU."""
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    import gpipe

    from .engine import generation_cases as gen

    model = gen.llama_model()
    want = gen.hf_greedy(copy.deepcopy(model).cuda(), gen.prompts(64), gen.NEW)
    pipe = Pipeline(gpipe.split(model, parts=1, plan="hf"), chunks=1, device="cuda")
    for chunk in (None, 4):
        assert pipe.generate(gen.prompts(64), gen.NEW, prefill_chunk=chunk) == want
