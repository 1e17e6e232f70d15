"""The memory of generating (``planning.generation``), and ``gpipe plan --generate``: each
stage's weights and the KV cache of every group in flight, counted as the caches hold them."""

import pytest
import torch

from gpipe.cli import main
from gpipe.models.gpt import GPTConfig, build_gpt
from gpipe.planning.generation import plan_generation
from gpipe.runtime.kv_cache import CacheContext, KVCache


def test_the_cache_is_every_row_of_every_group_at_the_full_context():
    found = plan_generation(
        [100, 200], [3, 2], kv_width=8, dtype_bytes=4, batch=10, context=16, in_flight=3
    )
    per_row = 2 * 16 * 8 * 4  # keys and values of one row in one layer
    assert found.rows_per_group == 4  # 10 sequences in 3 groups: 4, 3 and 3
    # every sequence once (the groups are not padded to one number of rows)
    assert [s.cache_bytes for s in found.stages] == [3 * 10 * per_row, 2 * 10 * per_row]
    assert [s.transient_bytes for s in found.stages] == [4 * per_row, 4 * per_row]  # the largest
    assert found.peak_bytes == 100 + 30 * per_row + 4 * per_row
    with pytest.raises(ValueError, match="in_flight must be a positive integer, got 0"):
        plan_generation([1], [1], kv_width=1, dtype_bytes=4, batch=1, context=1, in_flight=0)


def test_the_plan_counts_what_the_gpts_caches_hold():
    config = GPTConfig(n_layer=2, d_model=16, n_head=2, seq_len=12, vocab_size=32)
    model = build_gpt(config).eval()
    caches = [KVCache() for _ in range(2)]
    x = model[0].forward_cached(
        torch.zeros(3, 12, dtype=torch.long),
        None,
        CacheContext(torch.arange(12).expand(3, 12), torch.ones(3, 12, dtype=torch.bool)),
    )
    context = CacheContext(torch.arange(12).expand(3, 12), torch.ones(3, 12, dtype=torch.bool))
    for block, cache in zip(model[1:3], caches, strict=True):
        x = block.forward_cached(x, cache, context)
    held = sum(t.numel() * t.element_size() for c in caches for t in (c.keys, c.values))
    found = plan_generation([0], [2], kv_width=16, dtype_bytes=4, batch=3, context=12, in_flight=1)
    assert found.stages[0].cache_bytes == held


def test_gpipe_plan_generate_prints_each_stages_cache(capsys):
    argv = ["plan", "--generate", "--stages", "2", "--batch-size", "16", "--seq-len", "1024"]
    argv += ["--in-flight", "2", "--n-layer", "24", "--d-model", "1024", "--n-head", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "16 sequences of up to 1024 tokens, 2 groups in flight of up to 8 each" in out
    assert out.count("1.50 GiB") == 2  # 12 blocks x 16 rows x 1024 tokens x 2 x 1024 x 4 bytes
    assert main([*argv, "--device-memory", "2GiB"]) == 1  # 2.32 GiB a stage


def test_gpipe_plan_in_flight_needs_generate(capsys):
    assert main(["plan", "--in-flight", "2"]) == 2
    assert "--in-flight needs --generate" in capsys.readouterr().err


def test_the_gpts_caches_never_hold_more_columns_than_the_context():
    """A lane's buffers double when full, but never past the context the plan counts: a
    prompt of 25 tokens with 16 new ones (40 fed, of a context of 40) would otherwise grow
    its buffer to 2 x 26 columns at its first decoding step."""
    from ..engine.one_stage import stepped

    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, d_model=16, n_head=2, seq_len=40, vocab_size=32)
    model = build_gpt(config).eval()
    prompts = [[1] * 25, [2] * 3, [3] * 12]
    widest = 0
    for step in stepped(model, prompts, 16, 40, prefill_chunk=5):
        plan, caches = step  # the plan, whose tokens are checked at the end
        held = [c for lane in caches.lanes.values() for c in lane.caches if c is not None]
        for kv in (kv for cache in held for kv in cache.kv_layers() if kv.keys is not None):
            if not kv.keys.numel():
                continue  # no rows left
            # bytes of the whole buffer, over those of one column of every row
            column = kv.keys[..., :1, :].numel() * kv.keys.element_size()
            widest = max(widest, kv.keys.untyped_storage().nbytes() // column)
    assert [len(t) for t in plan.tokens] == [16, 16, 16]
    assert 26 < widest <= 40, widest
