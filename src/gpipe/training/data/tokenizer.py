"""Tokenizers for `gpipe train --tokenizer` and `gpipe sample`: bytes, a `tokenizer.json`, or a
Hugging Face tokenizer folder, all behind one small interface."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "IdTokenizer",
    "JsonTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "check_tokenizer",
]

# end-of-text tokens a tokenizer.json may define; the first one it has ends each JSON document
_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    """What the data and sampling need of a tokenizer."""

    name: str
    """Where it came from, for messages: ``"bytes"`` or the path given."""
    vocab_size: int
    """Every id it gives is below this."""
    eos_id: int | None
    """The id that ends a document (between JSON lines), or None if it has none."""

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without special tokens added."""
        ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, as fast as the tokenizer allows."""
        ...

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Ids back to text."""
        ...


def _ids(ids: Sequence[int] | Tensor) -> list[int]:
    return ids.flatten().tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]


class ByteTokenizer:
    """No tokenizer: a text's UTF-8 bytes are its ids (vocabulary 256), as `gpipe train` always
    read text; bytes that are not UTF-8 decode to U+FFFD."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        # a model with a wider vocabulary than bytes may pick an id above 255: U+FFFD
        held = b"".join(bytes([i]) if 0 <= i < 256 else b"\xef\xbf\xbd" for i in _ids(ids))
        return held.decode("utf-8", errors="replace")


class IdTokenizer:
    """Token ids shown as numbers: the text of a run trained on a token file with no
    tokenizer to decode it."""

    name = "ids"
    vocab_size = 1 << 32
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split() if word.isdigit()]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        return " ".join(map(str, _ids(ids)))


class JsonTokenizer:
    """A ``tokenizer.json`` read by the ``tokenizers`` library."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizers
        except ImportError:
            raise ValueError(
                f"--tokenizer {path}: reading a tokenizer.json needs the `tokenizers` package; "
                "pip install 'gpipe-parallel[hf]'"
            ) from None
        try:
            self._tok = _Tokenizers.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise ValueError(
                f"--tokenizer {path}: not a tokenizer.json the `tokenizers` library can read "
                f"({exc})"
            ) from None
        self.name = str(path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        found = (self._tok.token_to_id(token) for token in _END_OF_TEXT)
        self.eos_id = next((i for i in found if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        return str(self._tok.decode(_ids(ids), skip_special_tokens=False))


class HFTokenizer:
    """A Hugging Face tokenizer folder, loaded by ``transformers.AutoTokenizer`` from disk
    only (``local_files_only``: never a download)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(
                f"--tokenizer {path}: a Hugging Face tokenizer folder needs `transformers`; "
                "pip install 'gpipe-parallel[hf]' (or give the folder's tokenizer.json)"
            ) from None
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:  # a malformed file's error is whatever its reader met
            raise ValueError(
                f"--tokenizer {path}: no Hugging Face tokenizer in this folder "
                f"({str(exc).splitlines()[0]})"
            ) from None
        self.name = str(path)
        self.vocab_size = len(self._tok)  # added tokens included, unlike its .vocab_size
        self.eos_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return list(self._tok(texts, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        return str(self._tok.decode(_ids(ids)))


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer at ``path``: a ``tokenizer.json`` file, or a Hugging Face tokenizer folder
    (one without ``transformers`` installed is read through its ``tokenizer.json``); bytes
    without a path."""
    if path is None:
        return ByteTokenizer()
    where = Path(path)
    if where.is_file():
        return JsonTokenizer(where)
    if not where.is_dir():
        raise ValueError(
            f"--tokenizer {path} does not exist; expected a tokenizer.json or a Hugging Face "
            "tokenizer folder"
        )
    if not any((where / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"--tokenizer {path}: the folder holds neither tokenizer.json nor "
            "tokenizer_config.json; expected a Hugging Face tokenizer folder"
        )
    try:
        import transformers  # noqa: F401
    except ImportError:
        if (where / "tokenizer.json").is_file():
            return JsonTokenizer(where / "tokenizer.json")
    return HFTokenizer(where)


def check_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer whose ids would not all fit the model's embedding."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"--tokenizer {tokenizer.name} has a vocabulary of {tokenizer.vocab_size} tokens, "
            f"more than the model's vocab_size {vocab_size}; use the model's own tokenizer or "
            "a model with a larger vocabulary"
        )
