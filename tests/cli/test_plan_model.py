"""`gpipe plan --model hf:PATH|MODULE:FUNCTION`: the model cut by gpipe.split on the meta device,
each stage's weights, gradients and optimizer state exactly its parameters' bytes; the GPT's
flags beside another model, and a tokenizer wider than the model, refused in one line."""

import re
import textwrap

import pytest

import gpipe.cli.plan_model as plan_model
from gpipe.cli import main
from gpipe.planning.memory import format_bytes

from ..text_cases import llama_config

SHAPE = ["--stages", "2", "--chunks", "4", "--batch-size", "8", "--device-memory", "1GiB"]

FACTORY = """
import torch
from torch import nn


class Tiny(nn.Module):
    max_seq_len = 32

    def __init__(self, vocab=40, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x)


def build():
    return Tiny()
"""


def _rows(out: str) -> list[list[str]]:
    lines = [line for line in out.strip().splitlines() if not line.startswith("note:")]
    return [re.split(r"\s{2,}", line.strip()) for line in lines[2:]]


def _spy(monkeypatch) -> dict:
    """What gpipe.split and plan_model's plan return, to compare the table with."""
    import gpipe.splitting

    seen = {}

    def record(name, real):
        def spy(*args, **kwargs):
            seen[name] = real(*args, **kwargs)
            return seen[name]

        return spy

    monkeypatch.setattr(gpipe.splitting, "split", record("split", gpipe.splitting.split))
    monkeypatch.setattr(plan_model, "plan", record("plan", plan_model.plan))
    return seen


def _check_stage_bytes(seen: dict, out: str, states: int) -> None:
    """Each process's weights are its split stage's parameters x 4 bytes (float32), its
    gradients and optimizer state ``states`` times that, in the plan and in the table."""
    stages, result = seen["split"], seen["plan"]
    counts = [sum(p.numel() for p in stage.parameters()) for stage in stages]
    assert [r.params for r in result.ranks] == counts
    assert [r.param_bytes for r in result.ranks] == [4 * n for n in counts]
    assert [r.state_bytes for r in result.ranks] == [4 * n * states for n in counts]
    rows = _rows(out)
    assert [row[3] for row in rows] == [format_bytes(4 * n) for n in counts]
    assert [row[4] for row in rows] == [format_bytes(4 * n * states) for n in counts]


def test_a_hugging_face_llama_is_planned_per_split_stage(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers", reason="--model hf: needs transformers")
    llama_config(tmp_path / "llama", 96, 64)
    seen = _spy(monkeypatch)
    assert main(["plan", "--model", f"hf:{tmp_path / 'llama'}", *SHAPE]) == 0
    out = capsys.readouterr().out
    assert "seq_len 64" in out and "cut by parameters" in out  # the config's longest
    assert len(seen["split"]) == 2
    _check_stage_bytes(seen, out, states=3)  # adam: the gradient and two moments


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "plan_factory_model.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "plan_factory_model:build"


def test_a_factory_module_is_planned_per_split_stage(factory, monkeypatch, capsys):
    seen = _spy(monkeypatch)
    args = ["plan", "--model", factory, *SHAPE, "--optimizer", "momentum"]
    assert main([*args, "--split-at", "blocks.2"]) == 0
    out = capsys.readouterr().out
    assert "seq_len 32" in out and "cut at --split-at" in out  # the module's max_seq_len
    assert [row[1] for row in _rows(out)] == ["(input)", "blocks.2"]
    _check_stage_bytes(seen, out, states=2)  # the gradient and the momentum
    assert main([*args, "--split-at", "blocks.1,blocks.2"]) == 2
    assert "--split-at blocks.1,blocks.2 gives 3 stages" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "hf:nowhere", "--n-layer", "4", "--vocab-size", "9"],
         "--n-layer, --vocab-size: the built-in GPT's flags, but --model hf:nowhere"),
        (["--model", "mod:fn", "--no-tie-embeddings"], "--no-tie-embeddings: the built-in GPT"),
        (["--model", "mod:fn", "--suggest"], "--suggest searches the built-in GPT's layers"),
        (["--model", "mod:fn", "--balance", "even"], "is cut by gpipe.split by parameters"),
        (["--split-at", "h.2"], "--split-at cuts a model given by --model hf:"),
        (["--model", "nothing"], "--model must be gpt, hf:PATH"),
    ],
)  # fmt: skip
def test_options_for_another_model_are_refused_in_one_line(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def tokenizer(tmp_path):
    """A word-level tokenizer.json of 97 tokens (96 words and its unknown token)."""
    tokenizers = pytest.importorskip("tokenizers", reason="--tokenizer needs tokenizers")
    made = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    made.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    made.train_from_iterator([" ".join(f"w{i}" for i in range(96))], trainer)
    made.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json")


def test_a_tokenizer_wider_than_the_model_is_refused(tokenizer, factory, capsys):
    gpt = ["plan", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16"]
    assert main([*gpt, "--vocab-size", "50", "--tokenizer", tokenizer]) == 2
    err = capsys.readouterr().err
    assert "vocabulary of 97 tokens, more than the model's vocab_size 50" in err
    assert main(["plan", "--model", factory, *SHAPE, "--tokenizer", tokenizer]) == 2
    assert "more than the model's vocab_size 40" in capsys.readouterr().err


def test_a_tokenizer_sets_the_gpts_vocabulary(tokenizer, capsys):
    gpt = ["plan", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16"]
    assert main([*gpt, "--tokenizer", tokenizer]) == 0
    given = capsys.readouterr().out
    assert main([*gpt, "--vocab-size", "97"]) == 0
    assert given == capsys.readouterr().out
