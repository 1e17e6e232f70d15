"""Byte-level data: the built-in corpus, user text, and reproducible batches."""

import itertools

import pytest
import torch

from gpipe.data import BatchSampler, ByteDataset, decode, encode, load_text, stdlib_corpus


def test_stdlib_corpus_is_python_and_the_same_every_time():
    corpus = stdlib_corpus(max_bytes=200_000)
    assert len(corpus) == 200_000
    assert b"def " in corpus and b"import " in corpus
    stdlib_corpus.cache_clear()
    assert stdlib_corpus(max_bytes=200_000) == corpus


def test_stdlib_corpus_refuses_a_non_positive_cap():
    with pytest.raises(ValueError, match="max_bytes must be a positive integer, got 0"):
        stdlib_corpus(max_bytes=0)


def test_load_text_reads_a_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("héllo\n", encoding="utf-8")
    assert load_text(path) == "héllo\n".encode()


def test_load_text_reads_a_folder_in_order_skipping_binaries_and_hidden(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "sub" / "c.py").write_text("C")
    (tmp_path / "a.md").write_text("A")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00\x01")
    (tmp_path / ".git" / "HEAD").write_text("ref")
    assert load_text(str(tmp_path)) == b"ABC"


def test_load_text_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"nope'? does not exist"):
        load_text(missing)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="no readable UTF-8 text"):
        load_text(tmp_path)


def test_encode_decode_round_trip():
    text = "def f(x):\n    return x  # é ✓"
    ids = encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < 256
    assert decode(ids) == text
    assert decode(ids.tolist()) == text
    assert decode([0xFF]) == "\ufffd"
    assert encode("").shape == (0,)


def test_split_is_contiguous_with_val_last():
    data = bytes(range(100))
    dataset = ByteDataset.split(data, val_fraction=0.1)
    assert dataset.train.dtype == torch.uint8
    assert dataset.train.tolist() == list(range(90))
    assert dataset.val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 1.5"):
        ByteDataset.split(data, val_fraction=1.5)


def test_batches_are_windows_with_targets_shifted_by_one():
    data = torch.arange(200, dtype=torch.uint8)  # each byte is its own position
    x, y = BatchSampler(data, batch_size=5, seq_len=12, seed=0).next()
    assert x.shape == y.shape == (5, 12)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(5, 11, dtype=torch.long))
    assert torch.equal(y[:, -1], x[:, -1] + 1)


def test_every_window_fits_even_a_minimal_split():
    data = torch.arange(9, dtype=torch.uint8)
    sampler = BatchSampler(data, batch_size=4, seq_len=8, seed=1)
    for _ in range(3):
        x, y = sampler.next()
        assert torch.equal(x, torch.arange(8).expand(4, 8))
        assert torch.equal(y, torch.arange(1, 9).expand(4, 8))


def test_resumed_sampler_draws_the_same_next_batches():
    data = torch.randint(256, (1000,), dtype=torch.uint8)
    sampler = BatchSampler(data, 4, 16, seed=3)
    for _ in range(5):
        sampler.next()
    state = sampler.state_dict()
    expected = [sampler.next() for _ in range(3)]
    resumed = BatchSampler(data, 4, 16, seed=99)
    resumed.load_state_dict(state)
    assert resumed.step == 5
    for (x, y), (rx, ry) in zip(expected, (resumed.next() for _ in range(3)), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_same_seed_same_batches():
    data = torch.randint(256, (1000,), dtype=torch.uint8)
    a, b = BatchSampler(data, 4, 16, seed=5), BatchSampler(data, 4, 16, seed=5)
    for (xa, _), (xb, _) in itertools.islice(zip(a, b, strict=True), 3):
        assert torch.equal(xa, xb)


def test_sampler_errors_are_explained():
    with pytest.raises(ValueError, match=r"10 bytes, fewer than one window of seq_len 10 \+ 1"):
        BatchSampler(torch.zeros(10, dtype=torch.uint8), 2, 10)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        BatchSampler(torch.zeros(100, dtype=torch.uint8), 0, 10)
    with pytest.raises(ValueError, match=r"lacks \['step'\]"):
        BatchSampler(torch.zeros(100, dtype=torch.uint8), 2, 10).load_state_dict({"generator": 0})


def test_text_in_another_encoding_is_refused_by_name_never_skipped(tmp_path):
    """A Latin-1 file in a folder of UTF-8 text would otherwise drop out of the run unseen."""
    (tmp_path / "a.txt").write_text("fine\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes("café\n".encode("latin-1"))
    with pytest.raises(ValueError) as caught:
        load_text(tmp_path, flag="--data")
    message = str(caught.value)
    assert message.startswith(f"--data {tmp_path}: sub/b.txt is not UTF-8 text")
    assert "byte 0xe9 at offset 3" in message and "move it out of the folder" in message
    late = tmp_path / "late.txt"  # a single file, the wrong byte past where it was sniffed
    late.write_bytes(b"x" * 10_000 + b"\xe9")
    with pytest.raises(
        ValueError,
        match=r"late.txt is not UTF-8 text \(byte 0xe9 at offset "
        r"10000\); convert it to UTF-8$",
    ):
        load_text(late, flag="--val-data")
