"""`gpipe generate RUN --prompts FILE.jsonl --out FILE.jsonl --max-new-tokens N`: each prompt's
completion through the run's two stages, greedy, equal to the GPT's own sampler on the same
weights; `prompt` lines go through the run's tokenizer (bytes here) and `ids` lines as they
are; bad input is one line and exit code 2."""

import json
import warnings

import pytest
import torch

from gpipe.cli import main
from gpipe.models.gpt import GPTConfig, build_gpt, generate
from gpipe.training.checkpoints.format import save_checkpoint
from gpipe.training.generation_job import lanes_and_rows
from gpipe.training.options import TrainOptions

CONFIG = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=32, vocab_size=256)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    built = build_gpt(CONFIG)
    with torch.no_grad():
        for p in built.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)  # tokens that vary from step to step
    return built.eval()


@pytest.fixture(scope="module")
def run(model, tmp_path_factory):
    """A run folder of two stages with one checkpoint of ``model``, as a run would write."""
    folder = tmp_path_factory.mktemp("generate") / "run"
    train = {**TrainOptions().__dict__, "seq_len": CONFIG.seq_len}
    description = {"model": CONFIG.to_dict(), "train": train, "balance": [2, 2], "step": 1}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        save_checkpoint(folder / "checkpoints", 1, model, optimizer, {}, description)
    return folder


def _greedy(model, ids: list[int], new: int) -> list[int]:
    tokens = generate(model, torch.tensor([ids]), new, CONFIG.seq_len, top_k=1)
    return tokens[0, len(ids) :].tolist()


def test_generate_completes_each_prompt_as_the_unsplit_model(
    model, run, tmp_path, capsys, train_on_shared_processes
):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "def f(x):"}, {"ids": [7, 200, 3]}, {"prompt": "a", "tag": 1}]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(run), "--prompts", str(prompts), "--out", str(out)]
    assert main([*argv, "--max-new-tokens", "6", "--quiet", "--prefill-chunk", "4"]) == 0
    printed = capsys.readouterr().out
    assert "18 tokens for 3 prompts in" in printed and "tokens/s" in printed
    found = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [list(b"def f(x):"), [7, 200, 3], list(b"a")]
    for line, given, prompt in zip(found, lines, ids, strict=True):
        assert line == {**given, **{k: line[k] for k in ("completion_ids", "completion")}}
        assert line["completion_ids"] == _greedy(model, prompt, 6)
        assert line["completion"] == bytes(line["completion_ids"]).decode(errors="replace")


def test_generate_refuses_bad_input_in_one_line(run, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    out = str(tmp_path / "out.jsonl")
    cases = {
        '{"text": "x"}': "expected an object with 'prompt' (text) or 'ids'",
        '{"ids": [1, "2"]}': "'ids' must be a list of ints",
        "not json": "line 1: not JSON",
    }
    for line, message in cases.items():
        prompts.write_text(line + "\n")
        argv = ["generate", str(run), "--prompts", str(prompts), "--out", out]
        assert main([*argv, "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    argv = ["generate", str(run), "--prompts", str(prompts), "--out", out]
    assert main([*argv, "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be a positive integer" in capsys.readouterr().err
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')  # Latin-1
    argv = ["generate", str(run), "--prompts", str(prompts), "--out", out]
    assert main([*argv, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not UTF-8 text (invalid continuation byte" in err, err
    prompts.write_text('{"ids": [1, 2]}\n')
    missing = str(tmp_path / "no" / "out.jsonl")
    argv = ["generate", str(run), "--prompts", str(prompts), "--out", missing]
    assert main([*argv, "--max-new-tokens", "2"]) == 2  # before the stages start
    assert f"--out {missing}: the folder {tmp_path / 'no'} does not exist" in (
        capsys.readouterr().err
    )
    folder = tmp_path / "a folder"
    folder.mkdir()
    argv = ["generate", str(run), "--prompts", str(prompts), "--out", str(folder)]
    assert main([*argv, "--max-new-tokens", "2"]) == 2  # before the stages start
    err = capsys.readouterr().err.strip()
    assert err == f"gpipe: error: --out {folder}: a folder, not a file to write", err


def test_generate_refuses_bad_sampling_flags_by_name_before_the_stages_start(run, tmp_path, capsys):
    """A negative --temperature, a --top-p outside (0, 1] or a negative --eos-token-id were
    refused only once the stages had started and loaded the checkpoint, and then by
    ``generate``'s argument names (``top_p must be ...``), not the flags'."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"ids": [1, 2]}\n')
    argv = ["generate", str(run), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]
    for flags, message in (
        (["--temperature", "-1"], "--temperature must be a number >= 0 (0: greedy), got -1.0"),
        (["--temperature", "nan"], "--temperature must be a number >= 0 (0: greedy), got nan"),
        (["--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
        (["--top-p", "1.5"], "--top-p must be a number in (0, 1], got 1.5"),
        (["--top-p", "nan"], "--top-p must be a number in (0, 1], got nan"),
        (["--eos-token-id", "-2"], "--eos-token-id must be a token id (>= 0), got -2"),
    ):
        assert main([*argv, "--max-new-tokens", "2", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"gpipe: error: {message}", err


def test_sample_refuses_a_temperature_that_is_no_positive_number(run, capsys):
    """Refused in one line before the stages start: no traceback of the processes."""
    for given in ("0", "-1", "nan", "inf"):
        assert main(["sample", str(run), "--tokens", "2", "--temperature", given]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"gpipe: error: --temperature must be a positive number, got {float(given)}"
        ), err


def test_prompts_the_stages_refuse_end_in_one_line(
    run, tmp_path, capsys, train_on_shared_processes
):
    """The stages check the prompts against the model (its vocabulary, its context) and every
    rank refuses alike: the command says why in one line, naming the line of the file that
    holds the prompt (blank lines counted), with exit code 2."""
    prompts = tmp_path / "prompts.jsonl"
    out = tmp_path / "out.jsonl"
    good = '{"ids": [1]}\n\n'
    cases = {
        ('{"ids": [1, 300]}', 2): "line 1: the prompt holds token id 300 at position 1, "
        "outside the model's vocabulary of 256 ids (0 to 255)",
        (good + '{"ids": [1, 2, 3]}', 31): "line 3: the prompt has 3 tokens and "
        "max_new_tokens=31 more would feed the model 33 (all but the last new one), more "
        "than its context of 32",
        (good + '{"ids": []}', 2): "line 3: the prompt is empty: give at least one token id",
    }
    for (lines, new), message in cases.items():
        prompts.write_text(lines + "\n")
        argv = ["generate", str(run), "--prompts", str(prompts), "--out", str(out), "--quiet"]
        assert main([*argv, "--max-new-tokens", str(new)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"gpipe: error: --prompts {prompts}, {message}", err
    # an end of text outside the vocabulary, which only the stages know: said of the flag
    # (it was "eos_token_id must be ... or None", generate()'s argument)
    assert main([*argv, "--max-new-tokens", "2", "--eos-token-id", "300"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "gpipe: error: --eos-token-id must be a token id of the vocabulary (0 to 255), got 300"
    ), err
    assert not out.exists()
    prompts.write_text(
        '{"ids": [1]}\n'
    )  # and one that runs: "1 token for 1 prompt", not "1 prompts"
    assert main([*argv, "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().out.startswith("1 token for 1 prompt in ")


def test_batch_size_bounds_the_sequences_in_flight_in_all():
    """--batch-size B with --in-flight L: fewer lanes where B < L, and never more than B
    sequences at once (5 over 4 lanes once admitted 8)."""
    for batch in range(1, 12):
        for in_flight in range(1, 6):
            lanes, rows = lanes_and_rows(batch, in_flight)
            assert lanes == min(batch, in_flight) and rows >= 1
            assert lanes * rows <= batch < lanes * (rows + 1)


def test_a_traced_hugging_face_run_generates_as_its_unsplit_model(
    tmp_path, capsys, train_on_shared_processes
):
    """GPT-2 declares no pipeline plan, so `gpipe train` cut it by tracing, and traced stages
    keep no KV cache: `gpipe generate` cuts the trained model again at the run's places, by
    the layout read from its modules, and completes prompts of different lengths, in chunks,
    as the unsplit trained model's greedy `generate` does."""
    transformers = pytest.importorskip("transformers", reason="the test extra installs it")
    from gpipe.training.models.trained import checkpoint_at, load_trained

    config = transformers.GPT2Config(  # with dropout that a check run in training mode meets
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.5
    )
    config.save_pretrained(tmp_path / "gpt2")
    run = tmp_path / "run"
    train = [
        "train", "--model", f"hf:{tmp_path / 'gpt2'}", "--stages", "2", "--steps", "1",
        "--seq-len", "16", "--batch-size", "4", "--chunks", "2", "--sample-tokens", "1",
        "--threads", "1", "--quiet", "--out", str(run),
    ]  # fmt: skip
    assert main(train) == 0
    lines = [{"ids": [7]}, {"ids": [7, 200, 3]}, {"ids": [1, 2, 3, 4, 5, 6, 7]}]
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    argv = ["generate", str(run), "--prompts", str(prompts), "--out", str(out), "--no-eos"]
    assert main([*argv, "--max-new-tokens", "5", "--prefill-chunk", "2", "--quiet"]) == 0
    assert "15 tokens for 3 prompts in" in capsys.readouterr().out
    model = load_trained(checkpoint_at(run)).original.eval()
    model.generation_config.eos_token_id = None  # as --no-eos: five tokens each
    for line in map(json.loads, out.read_text().splitlines()):
        ids = torch.tensor([line["ids"]])
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert line["completion_ids"] == expected[0, ids.shape[1] :].tolist(), line
