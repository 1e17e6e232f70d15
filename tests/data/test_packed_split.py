"""Packed sequences through a split Hugging Face Llama, across two processes: a packed
micro-batch trains exactly like its documents each alone (tests/packed_cases.py)."""

import pytest

from .. import packed_cases
from ..workers import run

pytest.importorskip("transformers", reason="the examples extra installs transformers")


def test_packed_documents_train_like_the_same_documents_unpacked_under_every_schedule():
    results = run(packed_cases.equivalence, 2, threads=1)
    assert results == {0: 8, 1: 8}
