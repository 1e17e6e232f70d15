"""`gpipe plan --tensor-parallel T` and `gpipe simulate --tensor-parallel T`: per-rank figures,
the world K x D x T, a T the heads refuse, and --suggest choosing T."""

import re

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
