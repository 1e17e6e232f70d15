"""`gpipe plan --tensor-parallel T` and `gpipe simulate --tensor-parallel T`: per-rank figures,
the world K x D x T, a T the heads refuse, and --suggest choosing T."""

import re

import pytest

from gpipe.cli import main

SHAPE = ["plan", "--n-layer", "4", "--d-model", "128", "--n-head", "4", "--vocab-size", "256",
         "--seq-len", "32", "--optimizer", "adamw"]  # fmt: skip
MODEL = [*SHAPE, "--stages", "2", "--chunks", "2", "--batch-size", "4"]


def _states(out: str) -> list[str]:
    """Each row's grads+optimizer cell."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.strip().splitlines()]
    return [r[4] for r in rows if r[0].isdigit()]


def test_the_plan_says_t_and_shows_per_rank_figures(capsys):
    assert main([*MODEL, "--tensor-parallel", "2"]) == 0
    split = capsys.readouterr().out
    assert main(MODEL) == 0
    whole = capsys.readouterr().out
    assert "tensor parallel T=2" in split and "per tensor rank" in split
    assert "world K x D x T = 2 x 1 x 2 = 4 processes" in split
    assert "parameters/rank" in split and "T=" not in whole

    def mib(cell: str) -> float:
        value, unit = cell.split()
        return float(value) * {"KiB": 1 / 1024, "MiB": 1.0}[unit]

    for s, w in zip(_states(split), _states(whole), strict=True):
        assert mib(s) < 0.55 * mib(w)


def test_a_t_that_does_not_divide_the_heads_is_refused_in_one_line(capsys):
    assert main([*MODEL, "--tensor-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel 3 must divide the 4 attention heads" in err
    assert err.count("\n") == 1


def test_a_vocabulary_t_does_not_divide_is_refused_naming_it(capsys):
    argv = [*MODEL, "--tensor-parallel", "2", "--vocab-size", "255"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not divide the 255 vocabulary" in err and err.count("\n") == 1


def test_suggest_chooses_t_and_says_why(capsys):
    """In 4 MiB on at most 4 processes neither T = 1 nor T = 2 fits: T = 4 does."""
    argv = [*SHAPE, "--batch-size", "8", "--suggest", "--device-memory", "4MiB",
            "--schedule", "1f1b", "--checkpoint", "never", "--max-stages", "4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tried T = 1, 2, 4 (divisors of the 4 heads up to 4" in out
    assert "chose T=4, the fastest configuration that fits" in out
    assert "T=1: nothing fits" in out and "T=2: nothing fits" in out
    assert "--tensor-parallel 4" in out.splitlines()[-1]  # the fastest, last


def test_suggest_with_t_pinned_searches_only_it(capsys):
    argv = [*SHAPE, "--batch-size", "8", "--suggest", "--device-memory", "1GiB",
            "--tensor-parallel", "2", "--schedule", "1f1b", "--checkpoint", "never"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tried T = 2 (as given)" in out and "--tensor-parallel 2" in out


def test_simulate_splits_the_costs_and_adds_the_all_reduces(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text('{"forward": 1.0, "backward": 1.0, "weight": 1.0, "message_bytes": 1e9}')
    base = ["simulate", "--stages", "2", "--chunks", "4", "--schedule", "1f1b", "--costs"]
    assert main([*base, str(costs)]) == 0
    whole = capsys.readouterr().out
    assert main([*base, str(costs), "--tensor-parallel", "2"]) == 0
    split = capsys.readouterr().out
    assert "tensor parallel T=2" in split and "world K x D x T = 2 x 1 x 2 = 4" in split

    def makespan(out: str) -> float:
        return float(next(ln for ln in out.splitlines() if ln.startswith("1f1b")).split()[1])

    assert makespan(whole) / 2 < makespan(split) < makespan(whole)


def test_tp_link_without_t_is_refused(capsys):
    assert main([*MODEL, "--tp-link", "A100-80GB"]) == 2
    assert "--tp-link is the link of --tensor-parallel" in capsys.readouterr().err


def test_simulate_refuses_tp_allreduces_without_t_and_names_each_bad_flag(capsys, tmp_path):
    """--tp-allreduces was ignored without --tensor-parallel, and a bad T or count was told
    with the other flag's value beside it."""
    costs = tmp_path / "costs.json"
    costs.write_text('{"forward": 1.0, "backward": 1.0, "message_bytes": 1e9}')
    base = ["simulate", "--stages", "2", "--chunks", "4", "--schedule", "1f1b", "--costs"]
    refusals = {
        ("--tp-allreduces", "4"): "--tp-allreduces 4 counts the all-reduces of --tensor-parallel",
        ("--tensor-parallel", "0"): "--tensor-parallel must be a positive integer, got 0",
        ("--tensor-parallel", "2", "--tp-allreduces", "-1"): "--tp-allreduces must be at least "
        "0, got -1",
    }
    for flags, refusal in refusals.items():
        assert main([*base, str(costs), *flags]) == 2
        err = capsys.readouterr().err
        assert refusal in err and err.count("\n") == 1, err
    assert main([*base, str(costs), "--tensor-parallel", "2"]) == 0
    assert "for 2 all-reduces of 1e+09 bytes" in capsys.readouterr().out


def _llama(folder, kv_heads: int = 2) -> str:
    """A 2-block Llama (width 32, 4 heads of 16, ``kv_heads`` key/value heads, MLP 64,
    vocabulary 96, head untied) saved in ``folder``; its --model argument."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=32)  # fmt: skip
    config.save_pretrained(folder)
    return f"hf:{folder}"


def test_a_hugging_face_model_is_planned_per_tensor_rank(tmp_path, monkeypatch, capsys):
    """`--tensor-parallel 2 --model hf:` was refused ("plans the built-in GPT's split"): each
    stage's parameters are now its rank's share under the config's declared plan, counted by
    hand: a block's q, k, v, o and MLP maps halved (9,280 to 4,672 with its norms), the
    embedding whole, the head's vocabulary halved (3,072 to 1,536); a world of K x D x T.
    (T = 1 keeps the whole model: test_plan_model's Llama.)"""
    pytest.importorskip("transformers", reason="--model hf: needs transformers")
    import gpipe.cli.plan_model as plan_model

    seen = []
    real = plan_model.plan
    monkeypatch.setattr(plan_model, "plan", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    argv = ["plan", "--model", _llama(tmp_path / "llama"), "--stages", "2", "--chunks", "2",
            "--batch-size", "4", "--tensor-parallel", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert [r.params for r in seen[-1].ranks] == [3072 + 4672, 4672 + 32 + 1536]
    assert "per tensor rank" in out and "world K x D x T = 2 x 1 x 2 = 4 processes" in out


def test_a_hugging_face_t_its_heads_refuse_or_a_module_is_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("transformers", reason="--model hf: needs transformers")
    base = ["plan", "--model", _llama(tmp_path / "llama", kv_heads=1), "--stages", "2"]
    refusals = {
        ("--tensor-parallel", "2"): "--tensor-parallel 2: tensor_parallel=2 does not divide the "
        "1 heads of 0.model.layers.0.self_attn.k_proj",
        ("--tensor-parallel", "0"): "--tensor-parallel must be a positive integer, got 0",
    }
    for flags, refusal in refusals.items():
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err
        assert refusal in err and err.count("\n") == 1, err
    assert main(["plan", "--model", "mod:fn", "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert "for --model mod:fn plan one rank of each stage (T = 1)" in err


def test_tp_link_without_suggest_is_refused_not_ignored(capsys):
    """A plan of one configuration counts memory only: --tp-link (even a device that does not
    exist) was accepted and ignored."""
    assert main([*MODEL, "--tensor-parallel", "2", "--tp-link", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert "--tp-link nowhere times the collectives --suggest weighs" in err
    assert err.count("\n") == 1
