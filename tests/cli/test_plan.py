"""`gpipe plan`: the per-stage table, and --max-layers finds the largest model that fits."""

import io
import re

import pytest

from gpipe.cli import main
from gpipe.cli.plan import parse_bytes

MODEL = ["plan", "--d-model", "256", "--n-head", "4", "--vocab-size", "1000", "--seq-len", "128",
         "--stages", "4", "--chunks", "8", "--batch-size", "16"]  # fmt: skip


def _rows(out: str) -> list[list[str]]:
    lines = [line for line in out.strip().splitlines() if not line.startswith("note:")]
    return [re.split(r"\s{2,}", line.strip()) for line in lines[2:]]


def test_the_table_has_a_row_per_stage(capsys):
    code = main([*MODEL, "--n-layer", "6", "--device-memory", "1GiB", "--optimizer", "rmsprop"])
    out = capsys.readouterr().out
    assert code == 0
    assert "blocks 6" in out and "balance [2, 2, 2, 2]" in out and "rmsprop" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert all(r[-1] == "yes" for r in rows)


def test_replicas_add_an_all_reduce_column_and_share_the_batch(capsys):
    code = main([*MODEL, "--n-layer", "6", "--data-parallel", "2", "--device-memory", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "of 8 (of 16, over 2 replicas) sequences" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("rank"))
    assert "all-reduce" in header
    assert main([*MODEL, "--data-parallel", "32"]) == 2
    assert "--batch-size 16 cannot give each of --data-parallel 32" in capsys.readouterr().err


def _most(capsys, *more: str) -> int:
    code = main([*MODEL, "--device-memory", "256MiB", "--max-layers", *more])
    out = capsys.readouterr().out
    assert code == 0, out
    return int(re.search(r"most blocks that fit (\d+)", out).group(1))


def test_max_layers_is_the_edge_of_fitting(capsys):
    most = _most(capsys)
    for n_layer, fits in ((most, 0), (most + 1, 1)):
        code = main([*MODEL, "--n-layer", str(n_layer), "--device-memory", "256MiB"])
        capsys.readouterr()
        assert code == fits, n_layer  # exit code 1: does not fit


def test_recomputation_fits_more_layers(capsys):
    never = _most(capsys, "--checkpoint", "never")
    always = _most(capsys, "--checkpoint", "always")
    assert always > never


def test_max_layers_too_little_memory_names_what_the_smallest_needs(capsys):
    """It said only "not even the smallest model fits": now how small (2 blocks on 4
    stages) and the memory it needs, which a plan of that model prints as its largest total."""
    assert main([*MODEL, "--device-memory", "1MiB", "--max-layers"]) == 1
    told = capsys.readouterr().out
    assert main([*MODEL, "--n-layer", "2", "--device-memory", "1MiB"]) == 1
    totals = [row[-2] for row in _rows(capsys.readouterr().out)]
    need = max(totals, key=lambda cell: parse_bytes(cell.replace(" ", "")))
    assert f"2 blocks on 4 stages need {need} on the fullest process" in told


def test_sizes_and_bad_input():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5mib") == int(1.5 * 2**20)
    with pytest.raises(ValueError, match="--device-memory must be a size such as 16GiB"):
        parse_bytes("lots")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device-memory", "lots"], "--device-memory must be a size"),
        (["--n-layer", "0"], "--n-layer must be a positive integer, got 0"),
        (["--n-head", "3"], "--d-model 256 must be a multiple of --n-head 3"),
        (["--balance", "1,1"], "--balance must be time, params, even, or 4 positive"),
        (["--stages", "9", "--n-layer", "2"], "--stages 9 x --virtual-stages 1 is more than"),
        # a 0 given is given, not taken for a switch left off
        (["--top", "0"], "--top needs --suggest"),
        (["--max-stages", "0"], "--max-stages needs --suggest"),
        (
            ["--schedule", "zero-bubble-v", "--virtual-stages", "3"],
            "--schedule zero-bubble-v places two stages per process in a V: --virtual-stages "
            "is 2, got 3",
        ),
        (  # a V is two stages a process: 1 given is not taken for one
            ["--schedule", "v-min", "--virtual-stages", "1"],
            "--schedule v-min places two stages per process in a V: --virtual-stages is 2, got 1",
        ),
        (  # --suggest searched the V at two, saying --virtual-stages 2 was fastest
            [
                "--suggest",
                "--device-memory",
                "80GiB",
                "--schedule",
                "v-half",
                "--virtual-stages",
                "3",
            ],
            "--schedule v-half places two stages per process in a V: --virtual-stages is 2, got 3",
        ),
    ],
)
def test_bad_options_end_in_one_line(capsys, args, message):
    assert main([*MODEL, *args]) == 2
    assert message in capsys.readouterr().err


def test_sub_sequences_are_planned_as_the_library_plans_them(capsys):
    """--seq-chunks 4: the model profiled on one sub-sequence, with the keys and values each
    carries to the next; what the first process holds falls, the table is plan()'s."""
    import torch

    from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
    from gpipe.planning.memory import plan, profile, sub_sequence_carry

    options = ["--n-layer", "4", "--stages", "2", "--schedule", "1f1b", "--checkpoint", "always"]
    activations = {}
    for s in (1, 4):
        assert main([*MODEL, *options, "--seq-chunks", str(s)]) == 0
        out = capsys.readouterr().out
        assert ("as 4 sub-sequences" in out) == (s == 4)
        activations[s] = _rows(out)[0][5]
    model = build_gpt(GPTConfig(n_layer=4, d_model=256, n_head=4, vocab_size=1000), "meta")
    piece = torch.zeros(2, 32, dtype=torch.int64, device="meta")
    want = plan(
        profile(model, piece, target=piece, loss_fn=lm_loss),
        [3, 3],
        batch_size=16,
        chunks=8,
        schedule="1f1b",
        checkpoint="always",
        seq_chunks=4,
        carry_bytes=sub_sequence_carry(model, piece),
    ).ranks[0]
    assert activations[4] == f"{want.activation_bytes / 2**20:.2f} MiB"
    assert float(activations[4].split()[0]) < float(activations[1].split()[0])


def test_a_v_is_planned_on_two_stages_a_process_unasked_and_on_sub_sequences(capsys):
    """zero-bubble-v without --virtual-stages: four stages on two processes, as Pipeline
    places them; --seq-chunks 4 on the V holds less on each process than whole micro-batches."""
    options = ["--n-layer", "6", "--stages", "2", "--schedule", "zero-bubble-v"]
    held = {}
    for s in (1, 4):
        assert main([*MODEL, *options, "--checkpoint", "never", "--seq-chunks", str(s)]) == 0
        out = capsys.readouterr().out
        assert "balance [2, 2, 2, 2]" in out, out
        held[s] = [float(row[5].split()[0]) for row in _rows(out)]
    assert all(a < b for a, b in zip(held[4], held[1], strict=True)), held


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["--seq-chunks", "3"], "--seq-chunks 3 does not divide --seq-len 128"),
        (["--seq-chunks", "4", "--schedule", "interleaved"], "runs with --schedule gpipe, 1f1b"),
        (
            ["--seq-chunks", "2", "--schedule", "v-half"],
            "--seq-chunks 2 runs with --schedule gpipe, 1f1b, zero-bubble, zero-bubble-v, "
            "got v-half",
        ),
        (["--seq-chunks", "4", "--suggest"], "--seq-chunks 4 is not planned with --suggest yet"),
        (["--seq-chunks", "0"], "--seq-chunks must be a positive integer, got 0"),
    ],
)
def test_sub_sequences_that_cannot_be_planned_end_in_one_line(capsys, more, message):
    assert main([*MODEL, *more]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_sub_sequences_of_tensor_parallel_stages_carry_their_ranks_heads(capsys):
    """With --tensor-parallel 2 each rank's blocks carry their half of the heads' keys and
    values to the next sub-sequence, and the plan is made with it."""
    import torch

    from gpipe.models.gpt import GPTConfig, build_gpt
    from gpipe.planning.memory import sub_sequence_carry
    from gpipe.planning.tensor_share import local_share

    model = build_gpt(GPTConfig(n_layer=1, d_model=256, n_head=4, vocab_size=1000), "meta")
    piece = torch.zeros(2, 32, dtype=torch.int64, device="meta")
    whole = sub_sequence_carry(model, piece)
    assert sub_sequence_carry(local_share(model, 2), piece) == [b / 2 for b in whole]
    assert whole[1] == 2 * 32 * 256 * 4  # keys and values of 32 tokens, 256 wide, per row
    options = [*MODEL, "--n-layer", "4", "--stages", "2", "--schedule", "1f1b", "--seq-chunks",
               "4", "--checkpoint", "always", "--tensor-parallel", "2"]  # fmt: skip
    assert main(options) == 0
    assert "as 4 sub-sequences" in capsys.readouterr().out


class _ClosedPipe:
    """Standard output whose reader has gone (``gpipe plan ... | head``)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise io.UnsupportedOperation("fileno")  # as a captured stream's


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert main([*MODEL, "--n-layer", "6"]) == 141  # SIGPIPE's status, as a Unix command ends
    assert capsys.readouterr().err == ""  # no traceback
