"""Hugging Face interop of a run: models built from a config or folder (weights read lazily,
by stage), and the trained model exported back as a Hugging Face folder."""

from gpipe.training.hf.export import (
    Exported,
    export_hf,
    tokenizer_files,
)
from gpipe.training.hf.models import (
    LazyWeights,
    build_hf_meta,
    build_hf_zeros,
    hf_config,
    write_initial_weights,
)

__all__ = [
    "Exported",
    "LazyWeights",
    "build_hf_meta",
    "build_hf_zeros",
    "export_hf",
    "hf_config",
    "tokenizer_files",
    "write_initial_weights",
]
