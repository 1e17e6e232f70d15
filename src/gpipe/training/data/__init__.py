"""A run's data: the text or token files it reads, its tokenizer, documents for packing, and
the batches of each step, the same on every rank of a replica."""

from gpipe.training.data.corpus import (
    check_same_everywhere,
    check_same_text,
    load_corpus,
)
from gpipe.training.data.documents import (
    Documents,
    DocumentSampler,
    open_documents,
    prepare_documents,
    read_documents,
    starts_path,
)
from gpipe.training.data.run_data import (
    check_same_data,
    checked_documents,
    data_prepared,
    prepare_run_data,
    run_dataset,
    run_documents,
)
from gpipe.training.data.step_batches import (
    PackedBatches,
    StepBatch,
    WindowBatches,
    packed_inputs,
)
from gpipe.training.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IdTokenizer,
    JsonTokenizer,
    Tokenizer,
    check_tokenizer,
    load_tokenizer,
)
from gpipe.training.data.tokens import (
    Prepared,
    TokenDataset,
    check_vocabulary,
    check_windows,
    document_chunks,
    fingerprint,
    needs_preparing,
    open_dataset,
    prepare_tokens,
    read_tokens,
    token_dtype_for,
)

__all__ = [
    "ByteTokenizer",
    "DocumentSampler",
    "Documents",
    "HFTokenizer",
    "IdTokenizer",
    "JsonTokenizer",
    "PackedBatches",
    "Prepared",
    "StepBatch",
    "TokenDataset",
    "Tokenizer",
    "WindowBatches",
    "check_same_data",
    "check_same_everywhere",
    "check_same_text",
    "check_tokenizer",
    "check_vocabulary",
    "check_windows",
    "checked_documents",
    "data_prepared",
    "document_chunks",
    "fingerprint",
    "load_corpus",
    "load_tokenizer",
    "needs_preparing",
    "open_dataset",
    "open_documents",
    "packed_inputs",
    "prepare_documents",
    "prepare_run_data",
    "prepare_tokens",
    "read_documents",
    "read_tokens",
    "run_dataset",
    "run_documents",
    "starts_path",
    "token_dtype_for",
]
