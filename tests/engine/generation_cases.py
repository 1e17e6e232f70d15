"""What each process runs for ``Pipeline.generate`` in tests/engine/test_generation.py: greedy
tokens against the unsplit model's own (the GPT's sampler, Hugging Face's
``generate(do_sample=False)``, one prompt at a time, float32), sampling with a seed, sequences
ending at the end of text while prompts wait, and the refusals, on every rank alike."""

import copy

import torch
from torch import nn

import gpipe
from gpipe import Pipeline
from gpipe.engine.generation import GenerationRefused
from gpipe.models.gpt import GPTConfig, build_gpt, generate

from ..small_models import tiny_llama_config

LENGTHS = (3, 11, 1, 17, 6)  # prompts of different lengths
NEW = 10
SAMPLING = {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 7}


def gpt_model() -> nn.Sequential:
    """A tiny GPT whose weights are drawn wide, so that greedy tokens vary from step to step
    (GPT-2's small initialization repeats one token)."""
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=40, vocab_size=64))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval()


def prompts(vocab: int, lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy(model: nn.Module, ids: list[int], new: int) -> list[int]:
    """The GPT's own sampler, top-1: its argmax at every token, on the model's device."""
    device = next(model.parameters()).device
    tokens = generate(model, torch.tensor([ids], device=device), new, 40, top_k=1)
    return tokens[0, len(ids) :].tolist()


def gpt_greedy(new: int = NEW, device: str = "cpu") -> list[list[int]]:
    model = gpt_model().to(device)
    return [_greedy(model, p, new) for p in prompts(64)]


def gpt_pipeline(k: int) -> int:
    """Greedy through K stages, K and K + 1 groups in flight, whole and chunked prefill."""
    want = gpt_greedy()
    pipe = Pipeline(gpt_model(), chunks=1)
    checked = 0
    for in_flight in (None, k + 1):
        for chunk in (None, 4):
            got = pipe.generate(prompts(64), NEW, in_flight=in_flight, prefill_chunk=chunk)
            assert got == want, (in_flight, chunk, got, want)
            checked += 1
    # a prompt as long as the context still gets its one new token (which nothing reads)
    model, (full,) = gpt_model(), prompts(64, (40,))
    assert pipe.generate([full], 1) == [_greedy(model, full, 1)]
    return checked


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def gpt_after_a_failed_call(failing: int) -> list[str]:
    """A call that fails partway on rank ``failing`` (its layer raises on its fifth cached
    forward), caught on every rank: the other rank hears of it at once (it used to wait for
    the timeout, while a step the failing rank went on to could time out waiting for it);
    then a step equals the unsplit model's, and the next call generates what the first did,
    its peers' messages of the failed call left behind. Returns each call's outcome."""
    pipe = Pipeline(gpt_model(), chunks=2, timeout=5.0, loss_fn=_next_token_loss)
    want = pipe.generate(prompts(64), NEW)
    layer = pipe.generator().stage.layers[0]
    forward, calls = layer.forward_cached, [0]

    def failing_forward(*args, **kwargs):
        calls[0] += 1
        if torch.distributed.get_rank() == failing and calls[0] == 5:
            raise RuntimeError("a fault of this layer")
        return forward(*args, **kwargs)

    layer.forward_cached = failing_forward
    try:
        pipe.generate(prompts(64), NEW)
        failed = "returned"
    except Exception as exc:
        failed = f"{type(exc).__name__}: {exc}"
    layer.forward_cached = forward
    ids = torch.randint(64, (4, 12), generator=torch.Generator().manual_seed(5))
    reference = gpt_model()
    _next_token_loss(reference(ids[:, :-1]), ids[:, 1:]).backward()
    pipe.step(ids[:, :-1], ids[:, 1:])
    grads = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
    again = pipe.generate(prompts(64), NEW)
    return [failed, "the same" if again == want else f"{again} for {want}"]


def gpt_sampled() -> list[list[list[int]]]:
    """Sampled tokens with one seed, with 1, 2 and 3 groups in flight and chunks of 5; each
    rank returns them, for the test to compare across process counts."""
    pipe = Pipeline(gpt_model(), chunks=1)
    return [
        pipe.generate(prompts(64), NEW, in_flight=n, prefill_chunk=5, **SAMPLING) for n in (1, 2, 3)
    ]


def gpt_ends_and_waits() -> int:
    """Sequences end at the end of text (its own token kept) and their places go to waiting
    prompts: one row per lane, so four of the five prompts wait at first."""
    want = gpt_greedy()
    eos = want[1][3]
    ended = [w[: w.index(eos) + 1] if eos in w else w for w in want]
    pipe = Pipeline(gpt_model(), chunks=1)
    assert pipe.generate(prompts(64), NEW, eos_token_id=eos) == ended
    got = pipe.generator().generate(prompts(64), NEW, eos_token_id=eos, rows_per_lane=1)
    assert got == ended, (got, ended)
    waited = pipe.generator().generate(prompts(64), NEW, rows_per_lane=1, prefill_chunk=3)
    assert waited == want
    return 3


def llama_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(
        max_position_embeddings=48,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None  # no end of text: every token comes back
    return model.eval()


def hf_greedy(model, given: list[list[int]], new: int) -> list[list[int]]:
    """Hugging Face's own greedy generation, one prompt at a time, no padding, on the
    model's device."""
    found = []
    for p in given:
        ids = torch.tensor([p], device=model.device)
        mask = torch.ones_like(ids)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0
        )
        found.append(out[0, len(p) :].tolist())
    return found


def llama_pipeline() -> int:
    """Llama cut by its plan: each stage runs the model's own code with its own cache class."""
    model = llama_model()
    want = hf_greedy(model, prompts(64), NEW)
    pipe = Pipeline(gpipe.split(copy.deepcopy(model), parts=2, plan="hf"), chunks=1)
    checked = 0
    for chunk in (None, 4):
        assert pipe.generate(prompts(64), NEW, prefill_chunk=chunk) == want
        checked += 1
    return checked


def refusals() -> list[str]:
    """Bad input, each refused in one line on every rank."""
    pipe = Pipeline(gpt_model(), chunks=1)
    pipe.train()
    good = prompts(64)
    found = []
    for args, kwargs in (
        (([[5] * 41], 1), {}),
        (([[5] * 35], 10), {}),
        (([[5], []], 3), {}),
        ((good, 0), {}),
        (([[5, 64]], 3), {}),
        ((good, 3), {"temperature": -1.0}),
        ((good, 3), {"top_p": 0.0}),
        ((good, 3), {"in_flight": 0}),
        ((good, 3), {"prefill_chunk": 0}),
        ((["hello"], 3), {}),
        (([{5: 6}], 3), {}),
    ):
        try:
            pipe.generate(*args, **kwargs)
        except (ValueError, TypeError) as exc:
            found.append(f"{type(exc).__name__}: {exc}")
    try:  # refused, not taken for "no room": every sequence would come back empty
        pipe.generator().generate(good, 3, rows_per_lane=-1)
    except ValueError as exc:
        found.append(f"{type(exc).__name__}: {exc}")
    assert pipe.training and all(layer.training for layer in pipe.children())
    # a call that runs gives each module back the mode it had: a layer put in eval mode of
    # its own stays there while the others train again
    held = [m for m in pipe.modules() if isinstance(m, nn.Dropout)]
    held[0].eval()
    pipe.generate(good, 2)
    assert not held[0].training and all(m.training for m in held[1:]), "modes not kept"
    return found


class _Tokens(nn.Module):
    """A model ``gpipe.split`` traces: its stages keep no cache."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def no_cache() -> list[str]:
    """Models whose layers keep no cache, an arbitrary Sequential and a traced model, are
    refused before anything runs."""
    torch.manual_seed(0)
    traced = gpipe.split(_Tokens(), (torch.zeros(2, 3, dtype=torch.long),), at=["head"])
    found = []
    for layers in (nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8)), traced):
        pipe = Pipeline(layers, chunks=1)
        try:
            pipe.generate([[1, 2]], 2)
        except GenerationRefused as exc:
            found.append(str(exc))
    return found


def replicas() -> int:
    """Two pipelines side by side (D = 2 x K = 2): each generates its own prompts."""
    pipe = Pipeline(gpt_model(), chunks=1, data_parallel=2)
    assert pipe.replicas is not None
    mine = prompts(64, seed=1 + pipe.replicas.replica)
    model = gpt_model()
    want = [_greedy(model, p, NEW) for p in mine]
    assert pipe.generate(mine, NEW, prefill_chunk=4) == want
    return 1


def windows() -> bool:
    """``gpipe sample``'s continuation past the context (40), greedy: the first window is the
    prompt's end (30 tokens, 10 more fit), the next the last half of the full one (20, and
    20 more)."""
    from gpipe.training.sample_text import continued

    pipe = Pipeline(gpt_model(), chunks=1)
    ids = prompts(64, (30,))[0]
    got = continued(pipe, ids, 30, 40, seed=0, temperature=0.0)
    model = gpt_model()
    first = _greedy(model, ids, 10)
    second = _greedy(model, (ids + first)[-20:], 20)
    return got == first + second
