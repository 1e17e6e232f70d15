"""A run's data as the flags give it: text tokenized into the run folder (anew when the data or
the tokenizer changes), token files beside it read as they are, flags that would be ignored or
mislead refused, JSON lines of other encodings named, a document sampler resumed on other
documents. No process is started."""

import json
import os

import numpy as np
import pytest

from gpipe.cli import main
from gpipe.training.data.documents import Documents, DocumentSampler, read_documents
from gpipe.training.data.run_data import data_prepared, prepare_run_data, run_dataset
from gpipe.training.data.tokenizer import load_tokenizer
from gpipe.training.data.tokens import check_sources, open_dataset
from gpipe.training.options import TrainOptions

from ..text_cases import LINES, word_tokenizer


@pytest.fixture
def texts(tmp_path):
    pytest.importorskip("tokenizers", reason="--tokenizer needs tokenizers")
    word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("\n".join(LINES * 20))
    (tmp_path / "b.txt").write_text("the dog sat\n" * 40)
    return tmp_path


def _ids(tokenizer, path) -> list[int]:
    return load_tokenizer(tokenizer).encode(path.read_text())


def test_a_resumed_run_on_other_text_tokenizes_it_anew(texts):
    """The run folder's tokens are of the --data and --tokenizer given now: a run continued
    with another --data trained on the first one's tokens before."""
    tokenizer = str(texts / "tokenizer.json")
    first = TrainOptions(data=str(texts / "a.txt"), tokenizer=tokenizer)
    out = texts / "run"
    assert not data_prepared(first, out)
    prepare_run_data(first, out)
    assert data_prepared(first, out)
    assert np.fromfile(out / "tokens" / "train.bin", np.uint16).tolist() == _ids(
        tokenizer, texts / "a.txt"
    )
    then = TrainOptions(data=str(texts / "b.txt"), tokenizer=tokenizer)
    assert not data_prepared(then, out)
    prepare_run_data(then, out)
    assert data_prepared(then, out)
    dataset = run_dataset(then, out)
    got = [*dataset.train.tolist(), *dataset.val.tolist()]
    assert got == _ids(tokenizer, texts / "b.txt")
    os.utime(texts / "b.txt", ns=(0, 0))  # the same path, rewritten since
    assert not data_prepared(then, out)


def test_token_files_beside_tokenized_text_are_read_as_they_are(texts):
    """Text through a tokenizer with --val-data a token file, and the other way round: the
    token file is memory-mapped with --token-dtype, the text tokenized into the run folder
    (the first was refused as "already a token file", the second tokenized on every rank)."""
    tokenizer = str(texts / "tokenizer.json")
    ids = np.arange(40, dtype=np.uint32) % 9
    ids.tofile(texts / "ids.bin")
    text = TrainOptions(
        data=str(texts / "a.txt"),
        val_data=str(texts / "ids.bin"),
        tokenizer=tokenizer,
        token_dtype="uint32",
    )
    prepare_run_data(text, texts / "one")
    dataset = run_dataset(text, texts / "one")
    assert dataset.train.tolist() == _ids(tokenizer, texts / "a.txt")
    assert dataset.val.tolist() == ids.tolist() and dataset.val.dtype == np.uint32
    assert sorted(p.name for p in (texts / "one" / "tokens").iterdir()) == [
        "train.bin",
        "train.origin.json",
    ]
    tokens = TrainOptions(
        data=str(texts / "ids.bin"),
        val_data=str(texts / "b.txt"),
        tokenizer=tokenizer,
        token_dtype="uint32",
    )
    assert not data_prepared(tokens, texts / "two")
    prepare_run_data(tokens, texts / "two")
    dataset = run_dataset(tokens, texts / "two")
    assert dataset.train.tolist() == ids.tolist()
    assert dataset.val.tolist() == _ids(tokenizer, texts / "b.txt")
    assert (texts / "two" / "tokens" / "val.bin").is_file()


def test_flags_that_would_be_ignored_or_mislead_are_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text\n" * 50)
    np.arange(100, dtype=np.uint32).tofile(tmp_path / "ids.bin")
    with pytest.raises(ValueError, match=r"--token-dtype uint32 says how to read a \.bin"):
        check_sources(str(tmp_path / "a.txt"), None, "uint32")
    with pytest.raises(ValueError, match="--token-dtype uint32 .* the built-in corpus"):
        check_sources(None, None, "uint32")
    check_sources(str(tmp_path / "ids.bin"), None, "uint32")
    check_sources(str(tmp_path / "a.txt"), str(tmp_path / "ids.bin"), "uint32")
    check_sources(str(tmp_path / "a.txt"), None, "uint16")  # the default: nothing given
    same = os.path.relpath(tmp_path / "a.txt")
    with pytest.raises(ValueError, match="is --data itself"):
        check_sources(str(tmp_path / "a.txt"), same, "uint16")
    out = ["--out", str(tmp_path / "run"), "--preset", "tiny", "--quiet"]
    assert main(["train", "--data", str(tmp_path / "a.txt"), "--token-dtype", "uint32", *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--token-dtype uint32" in err, err
    assert not (tmp_path / "run").exists()


def test_json_lines_of_another_encoding_are_named_and_a_byte_order_mark_is_read(tmp_path):
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    for read in (lambda p: read_documents(p, None), open_dataset):
        with pytest.raises(ValueError, match=r"latin\.jsonl: line 2 is not UTF-8 \(byte 0xe9"):
            read(tmp_path / "latin.jsonl")
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "hi"}\n{"text": "yo"}\n')
    assert read_documents(tmp_path / "bom.jsonl", None).ids.tolist() == list(b"hi\nyo\n")


def test_a_document_sampler_resumed_on_fewer_documents_goes_on(tmp_path):
    """A --pack run resumed with a --data of fewer documents: the saved place lies past
    them, and the sampler begins their next epoch (it indexed past the end before)."""

    def documents(n: int) -> Documents:
        starts = np.arange(0, 5 * n + 1, 5, dtype=np.int64)
        return Documents(np.arange(5 * n, dtype=np.uint16), starts)

    sampler = DocumentSampler(documents(20), 20, 8, seed=0)
    for _ in range(3):
        sampler.next()
    fewer = DocumentSampler(documents(6), 20, 8, seed=0)
    fewer.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    pieces = fewer.next()
    assert (fewer.epoch, fewer.step) == (1, 4)
    assert sorted(int(p[0]) for p in pieces) == sorted({int(p[0]) for p in pieces})
    with pytest.raises(ValueError, match="position must not be negative, got -1"):
        fewer.load_state_dict({**fewer.state_dict(), "position": -1})
