"""The model a run trains (``--model``): the built-in GPT, a Hugging Face causal LM or a module
of the user's own, resolved and checked before any process starts, and loaded whole from a
checkpoint for sampling and export. (The GPT's tied copies are kept equal across stages by
``gpipe.parallel.ties``.)"""

from gpipe.training.models.resolve import (
    GPT_FLAGS,
    check_pack,
    longest_sequence,
    model_layer_count,
    quiet_tracer,
    resolve_model,
    starting_weights,
)
from gpipe.training.models.sources import (
    MODEL_FORMS,
    TrainModel,
    logits_of,
    model_from_dict,
    parse_model,
)
from gpipe.training.models.trained import (
    TrainedModel,
    check_code_named,
    checkpoint_at,
    hf_config_of,
    load_trained,
    trained_model,
)

__all__ = [
    "GPT_FLAGS",
    "MODEL_FORMS",
    "TrainModel",
    "TrainedModel",
    "check_code_named",
    "check_pack",
    "checkpoint_at",
    "hf_config_of",
    "load_trained",
    "logits_of",
    "longest_sequence",
    "model_from_dict",
    "model_layer_count",
    "parse_model",
    "quiet_tracer",
    "resolve_model",
    "starting_weights",
    "trained_model",
]
