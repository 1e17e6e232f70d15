"""A Hugging Face causal LM cut by its plan generates what the unsplit model generates: each
stage's layers against the model's own cache class, driven here in one process as the
pipeline drives them (the first stage's plan, every stage's caches in turn, the last stage's
pick), against ``generate(do_sample=False)`` one prompt at a time, for some of the families that
`gpipe train --model hf:` is tried with (sliding windows, soft-capped logits, GPT-NeoX's
names)."""

import warnings

import pytest
import torch

import gpipe
from gpipe.engine.generation import Sampler, Sampling, Scheduler
from gpipe.engine.generation.lanes import CachedStage, StageCaches, cache_refusal
from gpipe.engine.generation.sampling import picked
from gpipe.splitting import PlanError

pytest.importorskip("transformers", reason="the test extra installs transformers")

from .hf_families import build, tiny_config

# Llama: tests/engine/test_generation.py; LongCat-Flash: two attention layers, so two places
# in the cache, in each decoder layer; GPT-2 and BLOOM declare no plan (their layouts are
# read from their modules; BLOOM's layers return tuples and its attention biases by position)
FAMILIES = ("qwen3", "gemma2", "phi3", "gpt_neox", "longcat_flash", "gpt2", "bloom")
NEW = 6


def generated(stages, prompts, lanes: int, chunk: int | None) -> list[list[int]]:
    """Greedy tokens of ``prompts`` through ``stages``, one trip of one lane at a time."""
    plan = Scheduler(prompts, NEW, lanes=lanes, prefill_chunk=chunk)
    cpu = torch.device("cpu")
    caches = [StageCaches(CachedStage(s, i, cpu, None)) for i, s in enumerate(stages)]
    sampler = Sampler(Sampling())
    waiting = list(range(lanes))
    with torch.no_grad():
        while waiting:
            lane = waiting.pop(0)
            task = plan.task(lane)
            if task is None:
                continue
            x = torch.tensor(task.inputs)[:, None]
            pieces = [torch.tensor(p.ids)[None] for p in task.pieces]
            for stage in caches:
                x, pieces = stage.run(task, x, pieces)
            plan.take(lane, *picked(sampler, task, x, pieces))
            waiting.append(lane)
    return plan.tokens


def reference(model, prompts) -> list[list[int]]:
    found = []
    for p in prompts:
        ids = torch.tensor([p])
        mask = torch.ones_like(ids)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
        found.append(out[0, len(p) :].tolist())
    return found


def wide(kind: str):
    """The family's tiny model in float32, weights drawn wide so that tokens vary."""
    torch.manual_seed(0)
    # Multi-head latent attention expands its keys and values to every head, and real configs
    # say so (as many key-value heads as heads): the tiny config's 2 of 4 would send the
    # expanded keys down transformers' grouped-query path, which breaks on them.
    latent = hasattr(tiny_config(kind), "kv_lora_rank")
    heads = {"num_key_value_heads": tiny_config(kind).num_attention_heads} if latent else {}
    model = build(kind, dtype=torch.float32, **heads).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_through_the_plans_stages_equals_the_models_own_generate(kind):
    warnings.filterwarnings("ignore")
    model = wide(kind)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 9, 1, 13)]
    want = reference(model, prompts)
    stages = list(gpipe.split(model, parts=2, plan="hf"))
    assert generated(stages, prompts, lanes=3, chunk=3) == want


def test_attention_that_sees_later_tokens_is_refused():
    """A Gemma built with bidirectional attention keeps keys and values like any other, but
    a token cached for later ones, or a sub-sequence, would see fewer tokens than its whole
    forward does: refused by name (seq_chunks measured a loss 3e-4 off, gradients 9e-3)."""
    model = build("gemma", dtype=torch.float32, use_bidirectional_attention=True)
    stage = gpipe.split(model, parts=2, plan="hf")[0]
    with pytest.raises(PlanError, match=r"layer 0 \(self_attn\) attends to later tokens"):
        stage.new_cache()
    assert "cannot keep a KV cache" in (cache_refusal(torch.nn.Sequential(stage), 0) or "")
    from gpipe.runtime.seq_chunks import seq_chunk_refusal

    assert "attends to later tokens" in (seq_chunk_refusal(torch.nn.Sequential(stage)) or "")


@pytest.mark.parametrize(
    ("kind", "state"),
    [
        ("qwen3_5_text", "LinearAttentionLayer"),  # linear attention's recurrent state
        ("inkling_text", "LinearAttentionAndSlidingWindowAttentionLayer"),  # both, one layer
        ("deepseek_v32", "DynamicIndexedLayer"),  # a sparse attention's indexer keys too
    ],
)
def test_layers_without_keys_and_values_are_refused(kind, state):
    model = build(kind, dtype=torch.float32)
    stage = gpipe.split(model, parts=2, plan="hf")[0]
    with pytest.raises(PlanError, match=f"keeps a {state}, not keys and values"):
        stage.new_cache()
    assert "cannot keep a KV cache" in (cache_refusal(torch.nn.Sequential(stage), 0) or "")
