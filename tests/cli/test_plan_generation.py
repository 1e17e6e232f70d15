"""``gpipe plan --generate --model hf:...``: a Hugging Face model cut by its pipeline plan (or
the layout read from its modules), its keys and values ``num_key_value_heads x head_dim``
wide, counted as the stages that generate hold them."""

import json

import pytest
import torch

from gpipe.cli import main

LLAMA = {  # grouped queries: 4 heads of 8 over 2 key-value heads, keys 16 wide
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 32,
}
GPT2 = {"model_type": "gpt2", "n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 64}


def _config(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def test_a_model_with_a_pipeline_plan_is_planned_as_it_generates(tmp_path, capsys):
    """Its stages were cut by tracing, which keep no cache: every such model was refused."""
    argv = ["plan", "--generate", "--model", _config(tmp_path, LLAMA), "--stages", "2"]
    assert main([*argv, "--batch-size", "6", "--in-flight", "3"]) == 0
    out = capsys.readouterr().out
    assert "6 sequences of up to 32 tokens, 3 groups in flight of up to 2 each" in out
    # 2 layers x 6 rows x 32 tokens x (keys and values) x 16 x 4 bytes; growing: 2 rows
    assert out.count("48.00 KiB  8.00 KiB") == 2, out


def test_a_model_without_a_plan_is_cut_by_the_layout_of_its_modules(tmp_path, capsys):
    argv = ["plan", "--generate", "--model", _config(tmp_path, GPT2), "--stages", "3"]
    assert main([*argv, "--batch-size", "5", "--seq-len", "32", "--in-flight", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "3 stages, cut by its module layout" in lines[0]
    # layers 1, 2, 1, each 5 rows x 32 tokens x 2 x 32 x 4 bytes
    assert [line.split()[1] for line in lines[2:]] == ["1", "2", "1"]
    caches = [" ".join(line.split()[4:6]) for line in lines[2:]]
    assert caches == ["40.00 KiB", "80.00 KiB", "40.00 KiB"]


@pytest.mark.parametrize(
    ("flags", "cut"),
    [
        ([], "2 stages, cut by its plan"),
        (["--split-at", "model.layers.1"], "2 stages, cut at --split-at model.layers.1"),
    ],
)
def test_the_cut_is_said_as_it_was_made(tmp_path, capsys, flags, cut):
    argv = ["plan", "--generate", "--model", _config(tmp_path, LLAMA), "--stages", "2", *flags]
    assert main(argv) == 0
    assert cut in capsys.readouterr().out.splitlines()[0]


def test_split_at_alone_gives_the_stages(tmp_path, capsys):
    """Without --stages, the cuts say how many stages there are (not the default 4)."""
    argv = ["plan", "--generate", "--model", _config(tmp_path, LLAMA)]
    assert main([*argv, "--split-at", "model.layers.1"]) == 0
    assert "2 stages, cut at --split-at model.layers.1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("model", "flags", "said"),
    [
        (LLAMA, ["--split-at", "model.layers.2"], "--split-at model.layers.2 gives 2 stages, but"),
        (LLAMA, ["--split-at", "lm_head"], "'lm_head'] are not decoder layers a stage can begin"),
        # said with the flag typed, not split's parts=6
        (GPT2, ["--stages", "6"], "--stages 6 is more than the model's 4 decoder layers"),
    ],
)
def test_a_cut_that_does_not_fit_is_one_line(tmp_path, capsys, model, flags, said):
    argv = ["plan", "--generate", "--model", _config(tmp_path, model), "--stages", "3", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err and "Traceback" not in err, err
    assert "parts=" not in err, err


def test_a_cut_of_other_stages_than_asked_names_no_split_at_not_given(
    tmp_path, capsys, monkeypatch
):
    import gpipe.splitting

    cut = gpipe.splitting.split
    monkeypatch.setattr(gpipe.splitting, "split", lambda *a, **k: cut(*a, **{**k, "parts": 1}))
    argv = ["plan", "--generate", "--model", _config(tmp_path, LLAMA), "--stages", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "is cut into 1 stage, but --stages asks for 2" in err and "None" not in err, err


def test_the_plan_counts_what_the_caches_of_a_stage_hold(tmp_path, capsys):
    """The stages' own caches, filled to the context, hold what the plan counts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import gpipe

    from ..engine.one_stage import stepped

    argv = ["plan", "--generate", "--model", _config(tmp_path, LLAMA), "--stages", "1"]
    assert main([*argv, "--batch-size", "3", "--in-flight", "1"]) == 0
    planned = capsys.readouterr().out.splitlines()[-1].split()[4:6]
    config = AutoConfig.for_model(**LLAMA)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    stage = gpipe.split(model, parts=1, plan="hf")[0]
    held = 0
    for _, caches in stepped(stage, [[1] * 8, [2] * 3, [3] * 5], 24, 32):  # 31 columns at most
        layers = [kv for c in caches.lanes[0].caches if c is not None for kv in c.kv_layers()]
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for kv in layers
            for t in (kv.keys, kv.values)
            if t is not None
        }
        held = max(held, sum(storages.values()))
    # the last token is never fed: 31 columns of the 32 the plan counts
    assert planned == [f"{held * 32 / 31 / 1024:.2f}", "KiB"], (held, planned)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--stages", "0"], "--stages must be a positive integer, got 0"),  # was 4 stages
        # generate() runs no schedule: any one given would be ignored
        (["--virtual-stages", "2"], "--virtual-stages plans training; leave out --generate"),
        (["--schedule", "interleaved"], "--schedule plans training; leave out --generate"),
        (["--schedule", "1f1b"], "--schedule plans training; leave out --generate"),
        # generate() runs one pipeline of whole sequences: the training plan's options
        (["--data-parallel", "2"], "--data-parallel plans training; leave out --generate"),
        (["--chunks", "4"], "--chunks plans training; leave out --generate"),
        # a 0 given is given, not taken for a switch left off
        (["--chunks", "0"], "--chunks plans training; leave out --generate"),
        (["--top", "0"], "--top plans training; leave out --generate"),
        (["--max-stages", "0"], "--max-stages plans training; leave out --generate"),
        (["--measure"], "--measure plans training; leave out --generate"),
        (["--checkpoint", "always"], "--checkpoint plans training; leave out --generate"),
        (["--shard", "optimizer"], "--shard plans training; leave out --generate"),
    ],
)
def test_what_generate_cannot_run_is_refused_in_one_line(capsys, flags, said):
    assert main(["plan", "--generate", "--n-layer", "4", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err, err


def test_one_of_each_is_counted_in_the_singular(capsys):
    argv = ["plan", "--generate", "--n-layer", "2", "--stages", "1", "--batch-size", "1"]
    assert main([*argv, "--seq-len", "1"]) == 0
    assert "1 sequence of up to 1 token, 1 group in flight of up to 1 each (float32); 1 stage," in (
        capsys.readouterr().out
    )
