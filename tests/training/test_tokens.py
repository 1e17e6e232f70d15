"""Token data: token files memory-mapped, text through a tokenizer, the split, the checks."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpipe.data import BatchSampler, ByteDataset, load_text
from gpipe.training.data.tokenizer import ByteTokenizer, check_tokenizer, load_tokenizer
from gpipe.training.data.tokens import (
    TokenDataset,
    check_vocabulary,
    check_windows,
    fingerprint,
    needs_preparing,
    open_dataset,
    prepare_tokens,
    read_tokens,
    token_dtype_for,
)

from ..text_cases import LINES, word_tokenizer


def _old_batches(data, batch_size, seq_len, seed, count):
    """BatchSampler.next as it was before token arrays: the draws byte runs depend on."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    for _ in range(count):
        starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
        windows = data[starts[:, None] + offsets].long()
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_bin_file_is_memory_mapped_and_its_windows_are_its_ids(tmp_path, dtype):
    ids = np.arange(70_000 if dtype == "uint32" else 1000, dtype=dtype)
    ids.tofile(tmp_path / "tokens.bin")
    dataset = open_dataset(tmp_path / "tokens.bin", token_dtype=dtype)
    assert isinstance(dataset.train, np.memmap) and isinstance(dataset.val, np.memmap)
    assert len(dataset.val) == len(ids) // 10
    assert np.array_equal(np.concatenate([dataset.train, dataset.val]), ids)
    x, y = BatchSampler(dataset.train, 4, 8, seed=0).next()
    assert x.dtype == y.dtype == torch.int64 and x.shape == (4, 8)
    for row, target in zip(x, y, strict=True):
        start = int(row[0])
        assert row.tolist() == ids[start : start + 8].tolist()
        assert target.tolist() == ids[start + 1 : start + 9].tolist()


def test_an_npy_file_keeps_its_dtype_and_is_mapped(tmp_path):
    ids = np.arange(500, dtype=np.int32)
    np.save(tmp_path / "tokens.npy", ids)
    dataset = open_dataset(str(tmp_path / "tokens.npy"))
    assert dataset.train.dtype == np.int32 and isinstance(dataset.train, np.memmap)
    assert np.array_equal(np.concatenate([dataset.train, dataset.val]), ids)
    np.save(tmp_path / "floats.npy", np.zeros(10))
    with pytest.raises(ValueError, match="floats.npy: holds float64 values; expected integer"):
        open_dataset(tmp_path / "floats.npy")


@settings(max_examples=25, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**16 - 1), min_size=12, max_size=300),
    seq_len=st.integers(1, 10),
    seed=st.integers(0, 2**31),
)
def test_windows_are_contiguous_runs_of_the_array(ids, seq_len, seed):
    array = np.asarray(ids, dtype=np.uint16)
    x, y = BatchSampler(array, 3, seq_len, seed=seed).next()
    runs = {tuple(ids[i : i + seq_len + 1]) for i in range(len(ids) - seq_len)}
    for row, target in zip(x.tolist(), y.tolist(), strict=True):
        assert (*row, target[-1]) in runs and row[1:] == target[:-1]


def test_byte_data_draws_exactly_the_batches_it_drew_before(tmp_path):
    letters = np.random.default_rng(0).integers(32, 127, 5000, dtype=np.uint8)
    (tmp_path / "a.txt").write_bytes(letters.tobytes())
    tensor = ByteDataset.split(load_text(tmp_path / "a.txt")).train
    array = open_dataset(tmp_path / "a.txt").train
    for data in (tensor, array):
        sampler = BatchSampler(data, 4, 32, seed=7)
        old = _old_batches(tensor, 4, 32, seed=7, count=5)
        for (ox, oy), (x, y) in zip(old, (sampler.next() for _ in range(5)), strict=True):
            assert torch.equal(ox, x) and torch.equal(oy, y)


def test_sampler_on_an_array_resumes_from_its_state(tmp_path):
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    train = open_dataset(tmp_path / "t.bin").train
    sampler = BatchSampler(train, 4, 16, seed=3)
    for _ in range(4):
        sampler.next()
    state = sampler.state_dict()
    expected = [sampler.next() for _ in range(3)]
    resumed = BatchSampler(train, 4, 16, seed=99)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (resumed.next() for _ in range(3)), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    again = BatchSampler(train, 4, 16, seed=3)
    assert torch.equal(again.next()[0], BatchSampler(train, 4, 16, seed=3).next()[0])


def test_val_data_gives_the_validation_part(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "val.npy", np.arange(7, dtype=np.int64))
    dataset = open_dataset(tmp_path / "train.bin", val_data=tmp_path / "val.npy")
    assert len(dataset.train) == 100 and dataset.val.tolist() == list(range(7))
    assert dataset.val_source.startswith("--val-data") and dataset.vocab_bound is None


def test_text_without_a_tokenizer_is_bytes_as_before(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    dataset = open_dataset(tmp_path / "a.txt")
    assert dataset.vocab_bound == 256 and dataset.train.dtype == np.uint8
    reference = ByteDataset.split(load_text(tmp_path / "a.txt"))
    assert dataset.train.tolist() == reference.train.tolist()
    assert dataset.val.tolist() == reference.val.tolist()
    assert not needs_preparing(tmp_path / "a.txt", None)


def test_jsonl_documents_are_joined(tmp_path):
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(["ab", "c"])]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n\n")
    ids, bound = read_tokens(tmp_path / "d.jsonl")
    assert ByteTokenizer().decode(ids) == "ab\nc\n" and bound == 256
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r'bad.jsonl: line 2 has no "text" field.*\[\'body\'\]'):
        read_tokens(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="broken.jsonl: line 1 is not JSON"):
        read_tokens(tmp_path / "broken.jsonl")


def test_a_tokenizer_json_tokenizes_text_and_jsonl(tmp_path):
    tokenizer = load_tokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    assert tokenizer.vocab_size < 40 and tokenizer.eos_id == 1
    assert tokenizer.decode(tokenizer.encode("the cat sat")) == "the cat sat"
    (tmp_path / "a.txt").write_text("\n".join(LINES * 20))
    dataset = open_dataset(tmp_path / "a.txt", tokenizer=tokenizer)
    assert dataset.vocab_bound == tokenizer.vocab_size
    everything = np.concatenate([dataset.train, dataset.val]).tolist()
    assert everything[:3] == tokenizer.encode("the cat sat")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES))
    ids, _ = read_tokens(tmp_path / "d.jsonl", tokenizer=str(tmp_path / "tokenizer.json"))
    assert ids.tolist() == [i for line in LINES for i in (*tokenizer.encode(line), 1)]


def test_a_hugging_face_tokenizer_folder_loads_from_disk(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(word_tokenizer(tmp_path / "tokenizer.json")))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "folder")
    tokenizer = load_tokenizer(tmp_path / "folder")
    assert tokenizer.vocab_size == raw.get_vocab_size() and tokenizer.eos_id == 1
    assert tokenizer.encode("the dog") == raw.encode("the dog").ids


def test_prepare_tokens_writes_the_smallest_dtype_atomically(tmp_path):
    tokenizer = load_tokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("\n".join(LINES * 5))
    assert needs_preparing(tmp_path / "a.txt", tokenizer)
    prepared = prepare_tokens(tmp_path / "a.txt", tmp_path / "run" / "train.bin", tokenizer)
    assert prepared.token_dtype == "uint16" and [
        p.name for p in prepared.path.parent.iterdir()
    ] == ["train.bin"]
    mapped = open_dataset(prepared.path, token_dtype=prepared.token_dtype)
    direct = open_dataset(tmp_path / "a.txt", tokenizer=tokenizer)
    assert np.array_equal(mapped.train, direct.train) and np.array_equal(mapped.val, direct.val)
    assert token_dtype_for(65_536) == "uint16" and token_dtype_for(65_537) == "uint32"
    assert not needs_preparing(prepared.path, tokenizer)


def test_a_bin_of_the_wrong_size_names_the_file_its_size_and_the_dtype(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
    with pytest.raises(
        ValueError, match=r"odd.bin: its size, 6 bytes, .* uint32 .*--token-dtype uint16"
    ):
        open_dataset(tmp_path / "odd.bin", token_dtype="uint32")
    (tmp_path / "odder.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match=r"7 bytes, is not a whole number of uint16 token ids \(2"):
        open_dataset(tmp_path / "odder.bin")
    with pytest.raises(ValueError, match="--token-dtype must be uint16 or uint32, got 'int8'"):
        open_dataset(tmp_path / "odd.bin", token_dtype="int8")


def test_unknown_and_empty_files_are_refused(tmp_path):
    (tmp_path / "data.parquet").write_bytes(b"PAR1\0\0\x01\x02")
    with pytest.raises(ValueError, match=r"data.parquet: unknown file extension '.parquet'"):
        open_dataset(tmp_path / "data.parquet")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"--data .*empty.bin is empty \(0 bytes\)"):
        open_dataset(tmp_path / "empty.bin")
    with pytest.raises(ValueError, match="--val-data .*nope.bin does not exist"):
        open_dataset(None, val_data=tmp_path / "nope.bin")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "old.txt").write_bytes(b"na\xefve\n")  # Latin-1, not UTF-8
    with pytest.raises(ValueError, match=r"^--val-data .*texts: old.txt is not UTF-8 text"):
        open_dataset(None, val_data=tmp_path / "texts")
    tokenizer = load_tokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"^--data .*texts: old.txt is not UTF-8 text"):
        prepare_tokens(tmp_path / "texts", tmp_path / "t.bin", tokenizer)


def test_json_lines_in_a_json_file_are_refused_not_trained_on_as_text(tmp_path):
    """``datasets``' ``to_json`` writes JSON lines to a .json file: read as text, the run
    would learn the JSON syntax around every document."""
    lines = tmp_path / "train.json"  # a first line longer than the 8 KiB sniffed for text
    lines.write_text("".join(json.dumps({"text": "word " * 2000}) + "\n" for _ in range(3)))
    with pytest.raises(ValueError, match=r"^--val-data .*train.json holds JSON lines .*\.jsonl"):
        open_dataset(None, val_data=lines)
    pretty = tmp_path / "pretty.json"  # a JSON document is text like any other
    pretty.write_text(json.dumps({"text": "word " * 20}, indent=2))
    assert bytes(read_tokens(pretty)[0]) == pretty.read_bytes()
    minified = tmp_path / "one.json"  # so is one on one line
    minified.write_text(json.dumps({"title": "x", "items": [1, 2, 3]}))
    assert bytes(read_tokens(minified)[0]) == minified.read_bytes()


def test_check_vocabulary_scans_for_the_largest_id(tmp_path, monkeypatch):
    # the module's private chunk size, made small so that this small file spans several
    monkeypatch.setattr("gpipe.training.data.tokens._SCAN", 64)
    ids = np.arange(1000, dtype=np.uint16) % 300
    ids[917] = 4321
    ids.tofile(tmp_path / "t.bin")
    dataset = open_dataset(tmp_path / "t.bin")
    check_vocabulary(dataset, 5000)
    with pytest.raises(
        ValueError,
        match=r"t.bin: its validation part holds token id 4321 \(at index 17\).*vocabulary of 4096",
    ):
        check_vocabulary(dataset, 4096)
    np.save(tmp_path / "neg.npy", np.array([3, -2, 5] * 10, dtype=np.int16))
    with pytest.raises(ValueError, match="negative token id, -2"):
        check_vocabulary(open_dataset(tmp_path / "neg.npy"), 10)
    check_vocabulary(open_dataset(None), 256)  # bytes are known to fit: no scan


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    tokenizer = load_tokenizer(word_tokenizer(tmp_path / "tokenizer.json"))
    check_tokenizer(tokenizer, tokenizer.vocab_size)
    with pytest.raises(
        ValueError,
        match=f"vocabulary of {tokenizer.vocab_size} tokens, more than the model's vocab_size 8",
    ):
        check_tokenizer(tokenizer, 8)
    with pytest.raises(ValueError, match="--tokenizer .*missing does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: the folder holds neither tokenizer.json nor"):
        load_tokenizer(tmp_path / "empty")


def test_a_split_shorter_than_a_window_says_how_many_tokens_it_has(tmp_path):
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "t.bin")
    dataset = open_dataset(tmp_path / "t.bin")
    check_windows(dataset, 4)
    with pytest.raises(
        ValueError,
        match=r"its validation part has 5 tokens, fewer than one window of --seq-len 8 \+ 1",
    ):
        check_windows(dataset, 8)
    with pytest.raises(ValueError, match=r"the split has 5 tokens, fewer than one window"):
        BatchSampler(dataset.val, 2, 8)


def test_fingerprint_tells_different_data_apart(tmp_path):
    ids = np.arange(3 << 20, dtype=np.uint16)
    ids.tofile(tmp_path / "a.bin")
    ids[-1] ^= 1
    ids.tofile(tmp_path / "b.bin")
    a, b = open_dataset(tmp_path / "a.bin"), open_dataset(tmp_path / "b.bin")
    assert fingerprint(a) == fingerprint(open_dataset(tmp_path / "a.bin")) != fingerprint(b)
    small = TokenDataset(np.arange(5), np.arange(3), None, "x")
    assert fingerprint(small) != fingerprint(TokenDataset(np.arange(5), np.arange(1, 4), None, "x"))
