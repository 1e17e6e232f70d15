"""``gpipe train --data FILE.jsonl --pack``: whole documents packed into micro-batches of
near-equal tokens, each step's loss a mean over every target token, exactly.

A Hugging Face Llama run through a word tokenizer is checked against the same documents,
drawn and packed the same way, through the unsplit model; a GPT run on bytes, killed and
restarted on two replicas, goes on with the uninterrupted single-replica run's losses. The
runs are real processes over gloo."""

import io
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpipe.cli import main
from gpipe.data import counts_of, pack
from gpipe.models.gpt import GPTConfig, build_gpt
from gpipe.training.data.documents import Documents, DocumentSampler, read_documents

from .. import packed_cases
from ..text_cases import LINES, llama_config, word_tokenizer
from ..workers import run

# the runs that are not killed share the module's processes (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("train_on_shared_processes")

RUN = [
    "train", "--stages", "2", "--batch-size", "4", "--seq-len", "24", "--chunks", "4",
    "--lr", "1e-2", "--warmup", "2", "--eval-every", "4",
    "--sample-tokens", "4", "--quiet", "--timeout", "20", "--threads", "1", "--pack",
]  # fmt: skip


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of a long tail of lengths (most a few words, some several rows long), each
    one of LINES' sentences over and over, so the next word follows from the ones before."""
    folder = tmp_path_factory.mktemp("pack")
    rng = random.Random(0)
    with open(folder / "docs.jsonl", "w") as file:
        for _ in range(120):
            words = rng.choice(LINES).split()
            n = rng.randint(2, 8) if rng.random() < 0.85 else rng.randint(20, 60)
            file.write(json.dumps({"text": " ".join(words[i % len(words)] for i in range(n))}))
            file.write("\n")
    word_tokenizer(folder / "tokenizer.json")
    return folder


def test_a_packed_llama_step_is_the_unsplit_model_on_the_same_documents(corpus, tmp_path):
    """The first step's loss is the token mean over the step's documents, drawn and packed
    as the run does, through the unsplit model at the run's starting weights; the
    validation loss then falls well below a uniform guess."""
    transformers = pytest.importorskip("transformers", reason="--model hf: needs transformers")
    config = llama_config(tmp_path / "llama", 32, 32)
    out = tmp_path / "run"
    assert main([
        *RUN, "--model", f"hf:{config}", "--steps", "12",
        "--data", str(corpus / "docs.jsonl"), "--tokenizer", str(corpus / "tokenizer.json"),
        "--out", str(out), "--lr", "3e-2",
    ]) == 0  # fmt: skip
    records = _records(out)
    assert records[-1]["val_loss"] < 0.5 * math.log(32), records

    from gpipe.training.data.documents import open_documents
    from gpipe.training.data.tokenizer import load_tokenizer

    whole = open_documents(out / "tokens" / "train.bin", load_tokenizer(corpus / "tokenizer.json"))
    train, _ = whole.split(0.1)
    pieces = DocumentSampler(train, 4 * 24, 24, seed=0).next()
    model = transformers.LlamaForCausalLM.from_pretrained(out / "initial")
    microbatches = pack(pieces, 24, 4)
    total = sum(
        F.cross_entropy(
            model(**{k: x[k] for k in ("input_ids", "position_ids")}).logits.flatten(0, 1),
            y.flatten(),
            reduction="sum",
        )
        for x, y in microbatches
    )
    want = float(total.detach() / counts_of(microbatches).sum())
    assert records[0]["loss"] == pytest.approx(want, rel=1e-5)


def test_killed_and_restarted_on_two_replicas_it_goes_on_like_one_pipeline(
    corpus, tmp_path, monkeypatch
):
    """The GPT on bytes: an uninterrupted run of one pipeline of 2 stages, and one of two
    replicas of 1 stage whose rank 1 is killed at step 7 and restarted from the step-4
    checkpoint. The replicas pack the same documents into twice the micro-batches, so their
    token mean is the same loss up to float32 rounding; a sampler resumed at the wrong
    document would not be."""
    common = [*RUN, "--preset", "tiny", "--data", str(corpus / "docs.jsonl"), "--steps", "10",
              "--save-every", "4", "--batch-size", "8"]  # fmt: skip
    one = tmp_path / "one"
    assert main([*common, "--stages", "2", "--out", str(one)]) == 0
    kill = {"rank": 1, "step": 7, "at": "step", "once": str(tmp_path / "killed")}
    monkeypatch.setenv("GPIPE_TEST_KILL", json.dumps(kill))
    two = tmp_path / "two"
    more = ["--stages", "1", "--data-parallel", "2", "--max-restarts", "1"]
    assert main([*common, *more, "--out", str(two)]) == 0
    assert (tmp_path / "killed").exists()
    got, want = _records(two), _records(one)
    assert [r["step"] for r in got] == list(range(1, 11))
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5), (a, b)


def test_the_gpt_keeps_packed_documents_apart_exactly():
    """Packed rows through the GPT equal each document alone (float64): loss and every
    gradient."""
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64))
    model = model.double()
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 64, (n,), generator=generator) for n in (5, 9, 3, 11, 6, 4, 8)]
    packed = [
        ({"input_ids": x["input_ids"], "position_ids": x["position_ids"]}, y)
        for x, y in pack(docs, 16, 2)
    ]
    loss = sum(
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") for x, y in packed
    )
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = sum(F.cross_entropy(model(d[None])[0, :-1], d[1:], reduction="sum") for d in docs)
    alone.backward()
    torch.testing.assert_close(loss, alone, rtol=1e-12, atol=1e-12)
    for got, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-12)


def _documents(lengths) -> Documents:
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Documents(np.arange(starts[-1], dtype=np.uint16), starts)


def test_the_document_sampler_covers_every_target_once_an_epoch_and_resumes_exactly():
    docs = _documents([3, 1, 40, 7, 2, 15])  # one of a single token: nothing to predict
    sampler = DocumentSampler(docs, 20, 10, seed=4)
    pieces = [p for _ in range(5) for p in sampler.next()]
    assert all(2 <= len(p) <= 10 for p in pieces)
    predicted = sorted(int(t) for p in pieces[:10] for t in p[1:])  # the first epoch's 10
    every = [
        t
        for a, b in zip(docs.starts[:-1], docs.starts[1:], strict=True)
        for t in range(a + 1, b)
        if b - a >= 2
    ]
    assert predicted == sorted(every)
    state = sampler.state_dict()
    ahead = [sampler.next() for _ in range(4)]
    again = DocumentSampler(docs, 20, 10, seed=4)
    again.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint holds it
    for want in ahead:
        assert [p.tolist() for p in again.next()] == [p.tolist() for p in want]


def test_documents_are_held_out_whole(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "ab" * n}) + "\n" for n in range(1, 21)))
    docs = read_documents(path, None)
    assert len(docs) == 20 and np.diff(docs.starts)[0] == 3  # "ab" and a newline
    train, val = docs.split(0.1)
    assert (len(train), len(val)) == (18, 2)
    assert val.ids[val.starts[0] : val.starts[1]].tolist() == list(b"ab" * 19 + b"\n")


@pytest.mark.parametrize(
    "more, expected",
    [
        (["--data", "{bin}"], "--data must be a JSON lines file"),
        (["--data", "{jsonl}", "--val-data", "{bin}"], "--val-data must be a JSON lines file"),
        (["--data", "{jsonl}", "--schedule", "auto"], "--pack with --schedule auto"),
        (["--data", "{jsonl}", "--batch-size", "2"], "cannot fill --chunks 4"),
        (["--data", "{one}"], "at least 2 documents"),
        (["--data", "{empty}"], "empty.jsonl: its training part has no document of 2 tokens"),
    ],
)
def test_bad_pack_input_is_one_line(corpus, tmp_path, capsys, more, expected):
    (tmp_path / "t.bin").write_bytes(b"\0" * 64)
    (tmp_path / "one.jsonl").write_text('{"text": "a single document"}\n')
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n' * 20)
    where = {"bin": tmp_path / "t.bin", "jsonl": corpus / "docs.jsonl",
             "one": tmp_path / "one.jsonl", "empty": tmp_path / "empty.jsonl"}  # fmt: skip
    args = [a.format(**where) for a in more]
    assert main([*RUN, "--preset", "tiny", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_packed_documents_cross_gpt_stages_exactly():
    """Two processes, each a stage of the GPT: what the first sends on is the hidden states
    and each token's document (tests/packed_cases.py)."""
    assert run(packed_cases.gpt_equivalence, 2, threads=1) == {0: 4, 1: 4}


def test_prepared_documents_that_are_not_what_was_written_are_named(tmp_path):
    """A run's tokens/ files edited or damaged: one line naming them, not numpy's advice to
    load the file with pickles allowed."""
    from gpipe.training.data.documents import open_documents, starts_path
    from gpipe.training.data.tokenizer import ByteTokenizer
    from gpipe.training.data.tokens import token_dtype_for

    ids = tmp_path / "train.bin"
    ids.write_bytes(np.arange(10, dtype=token_dtype_for(256)).tobytes())
    cases = {
        "random bytes": b"\x93NUMPY garbage",
        "pickled objects": _npy(np.array([0, "x"], dtype=object)),
        "starts past the ids": _npy(np.array([0, 4, 11], dtype=np.int64)),
        "starts that go back": _npy(np.array([0, 6, 3, 10], dtype=np.int64)),
    }
    for what, content in cases.items():
        starts_path(ids).write_bytes(content)
        with pytest.raises(ValueError, match="not the token ids and document starts") as error:
            open_documents(ids, ByteTokenizer())
        assert "pickle" not in str(error.value), what
    starts_path(ids).write_bytes(_npy(np.array([0, 4, 10], dtype=np.int64)))
    assert len(open_documents(ids, ByteTokenizer())) == 2


def _npy(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()
