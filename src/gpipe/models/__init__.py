"""Reference models, written as flat lists of layers a pipeline can cut anywhere: the GPT
(``gpt``, its names re-exported here) and a small ResNet (``gpipe.models.resnet.resnet``)."""

from gpipe.models.gpt import (
    PRESETS,
    Block,
    Embedding,
    GPTConfig,
    Head,
    build_gpt,
    config_from_preset,
    count_parameters,
    generate,
    lm_loss,
    sync_tied_grads_,
    tie_,
    tied_weights,
)

__all__ = [
    "GPTConfig",
    "PRESETS",
    "config_from_preset",
    "Embedding",
    "Block",
    "Head",
    "build_gpt",
    "tied_weights",
    "tie_",
    "sync_tied_grads_",
    "count_parameters",
    "lm_loss",
    "generate",
]
