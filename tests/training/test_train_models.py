"""``gpipe train`` on models and data of the user's own: a Hugging Face Llama built from a
config and a token file the test writes, a module given as ``MODULE:FUNCTION``, and each
bad input refused in one line before any process starts.

The runs are real processes over gloo; the kill is a real SIGKILL planned through
``GPIPE_TEST_KILL``. One uninterrupted run serves as the reference of the others.
"""

import json
import math
import sys
import textwrap

import numpy as np
import pytest

from gpipe.cli import main

from ..text_cases import llama_config
from ..workers import training_on_shared_processes

transformers = pytest.importorskip("transformers", reason="--model hf: needs transformers")

pytestmark = pytest.mark.usefixtures("train_on_shared_processes")

VOCAB = 96
RUN = [
    "train", "--stages", "2", "--batch-size", "8", "--seq-len", "32", "--chunks", "4",
    "--lr", "1e-2", "--warmup", "2", "--eval-every", "4", "--sample-tokens", "4", "--quiet",
    "--timeout", "20", "--threads", "1",
]  # fmt: skip


def _losses(run) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def _val_losses(run) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A 2-layer Llama config and a uint16 token file: a random cycle through the
    vocabulary, so each next token follows from the one before and the loss can fall far
    below a uniform guess's."""
    folder = tmp_path_factory.mktemp("inputs")
    llama_config(folder / "llama", VOCAB, 64)
    cycle = np.random.default_rng(0).permutation(VOCAB)
    np.tile(cycle, 200).astype(np.uint16).tofile(folder / "tokens.bin")
    return folder


def _hf(inputs, out, *more):
    return main([
        *RUN, "--model", f"hf:{inputs / 'llama' / 'config.json'}",
        "--data", str(inputs / "tokens.bin"), "--out", str(out), *more,
    ])  # fmt: skip


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """The uninterrupted run: 12 steps, a checkpoint every 4."""
    out = tmp_path_factory.mktemp("reference") / "run"
    with training_on_shared_processes():
        assert _hf(inputs, out, "--steps", "12", "--save-every", "4") == 0
    return out


def test_a_hugging_face_llama_trains_on_a_token_file(reference):
    """The validation loss falls well below the uniform guess's, ln(vocabulary)."""
    val = _val_losses(reference)
    assert val[-1] < 0.6 * math.log(VOCAB), val
    run = json.loads((reference / "run.json").read_text())
    assert run["model"]["source"].startswith("hf:")
    assert run["config"]["data"].endswith("tokens.bin")
    assert (reference / "initial" / "model.safetensors").is_file()  # drawn once, read by rank


def test_sample_of_a_token_file_run_takes_and_prints_ids(reference, capsys):
    assert main(["sample", str(reference), "--prompt", "3 5", "--tokens", "4"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids[:2] == ["3", "5"] and len(ids) == 6 and all(0 <= int(i) < VOCAB for i in ids)


def test_killed_and_restarted_it_goes_on_with_the_same_losses(
    inputs, reference, tmp_path, monkeypatch
):
    kill = {"rank": 1, "step": 7, "at": "step", "once": str(tmp_path / "killed")}
    monkeypatch.setenv("GPIPE_TEST_KILL", json.dumps(kill))
    out = tmp_path / "run"
    assert _hf(inputs, out, "--steps", "12", "--save-every", "4", "--max-restarts", "1") == 0
    assert (tmp_path / "killed").exists()
    assert _losses(out) == _losses(reference)


def test_fine_tuning_the_exported_model_on_two_replicas_in_bfloat16(inputs, reference, tmp_path):
    """The reference run exported as a Hugging Face folder and fine-tuned from it, 2 x 2
    processes in bfloat16: each rank reads its stage's trained weights, so the first step's
    loss is the trained model's, far below a fresh one's."""
    exported = tmp_path / "exported"
    assert main(["export", str(reference), "--hf", str(exported)]) == 0
    out = tmp_path / "run"
    more = ["--data-parallel", "2", "--precision", "bf16", "--eval-every", "2"]
    code = main([
        *RUN, "--model", f"hf:{exported}", "--data", str(inputs / "tokens.bin"),
        "--out", str(out), "--steps", "2", *more,
    ])  # fmt: skip
    assert code == 0
    assert not (out / "initial").exists()  # the folder's weights, not fresh ones
    first, trained = _losses(out)[1], _losses(reference)[12]
    assert first < 0.7 * math.log(VOCAB) and abs(first - trained) < 0.5, (first, trained)


FACTORY = '''
import torch
from torch import nn


class Tiny(nn.Module):
    """Not a Sequential: gpipe.split cuts it."""

    def __init__(self):
        super().__init__()
        self.max_seq_len = 64
        self.embed = nn.Embedding(96, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(32, 96)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Branchy(Tiny):
    def forward(self, ids):
        x = self.embed(ids)
        if x.sum() > 0:  # control flow on values: cannot be traced
            x = x * 2
        return self.head(x)


def tiny():
    return Tiny()


def branchy():
    return Branchy()
'''


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    yield "my_models"
    sys.modules.pop("my_models", None)


def test_a_module_of_your_own_trains(inputs, factory, tmp_path):
    out = tmp_path / "run"
    code = main([*RUN, "--model", f"{factory}:tiny", "--data", str(inputs / "tokens.bin"),
                 "--out", str(out), "--steps", "6", "--split-at", "blocks.1"])  # fmt: skip
    assert code == 0
    losses = _losses(out)
    assert losses[6] < losses[1]
    assert json.loads((out / "run.json").read_text())["model"]["split_at"] == ["blocks.1"]


def _refused(capsys, args) -> str:
    assert main(args) == 2
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0, message
    return message


def test_bad_input_is_one_line_before_any_process_starts(inputs, factory, tmp_path, capsys):
    llama = f"hf:{inputs / 'llama' / 'config.json'}"
    data = ["--data", str(inputs / "tokens.bin"), "--out", str(tmp_path / "run")]
    message = _refused(capsys, [*RUN, "--model", f"{factory}:branchy", *data])
    assert "branchy" in message and "trace" in message.lower()

    transformers.ViTConfig().save_pretrained(tmp_path / "vit")
    message = _refused(capsys, [*RUN, "--model", f"hf:{tmp_path / 'vit'}", *data])
    assert "not a causal language model" in message

    damaged = tmp_path / "damaged"  # read here, not first in each stage's process
    damaged.mkdir()
    (damaged / "config.json").write_text((inputs / "llama" / "config.json").read_text())
    (damaged / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    message = _refused(capsys, [*RUN, "--model", f"hf:{damaged}", *data])
    assert "its weights cannot be read" in message

    (tmp_path / "typed").mkdir()  # huggingface_hub's validation error is no ValueError
    (tmp_path / "typed" / "config.json").write_text('{"model_type": "llama", "hidden_size": "x"}')
    message = _refused(capsys, [*RUN, "--model", f"hf:{tmp_path / 'typed'}", *data])
    assert "not a Hugging Face config" in message

    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    message = _refused(capsys, [*RUN, "--model", llama, "--data", str(tmp_path / "odd.bin")])
    assert "odd.bin" in message and "uint16" in message

    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "wide.bin")
    message = _refused(capsys, [*RUN, "--model", llama, "--data", str(tmp_path / "wide.bin")])
    assert "899" in message and str(VOCAB) in message

    message = _refused(capsys, [*RUN, "--model", llama, *data, "--n-layer", "3"])
    assert "--n-layer" in message

    message = _refused(capsys, [*RUN, "--model", llama, *data, "--stages", "9"])
    assert "--stages 9 is more than the model's 2 decoder layers" in message

    (tmp_path / "docs.jsonl").write_text('{"text": "a cat"}\n{"text": "a dog"}\n')
    jsonl = ["--data", str(tmp_path / "docs.jsonl"), "--pack", "--out", str(tmp_path / "run")]
    message = _refused(capsys, [*RUN, "--model", f"{factory}:tiny", *jsonl])
    assert "--pack" in message and "document boundaries" in message

    (tmp_path / "run.toml").write_text("stages = 2\nlearning_rate = 0.1\n")
    message = _refused(capsys, [*RUN, "--config", str(tmp_path / "run.toml")])
    assert "learning_rate" in message


def test_a_tokenizer_wider_than_the_model_is_refused(inputs, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(2 * VOCAB)]
    tokenizer.train_from_iterator(
        [" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(" ".join(words) * 10)
    message = _refused(capsys, [
        *RUN, "--model", f"hf:{inputs / 'llama' / 'config.json'}", "--out", str(tmp_path / "r"),
        "--data", str(tmp_path / "text.txt"), "--tokenizer", str(tmp_path / "tokenizer.json"),
    ])  # fmt: skip
    assert str(2 * VOCAB + 1) in message and str(VOCAB) in message
