"""Which model a run trains (``--model``): the built-in GPT, a Hugging Face causal LM, or a
module of your own, and what every rank needs to know about it.

A ``TrainModel`` is the one thing the training job asks of a model: its layers (an
``nn.Sequential`` the pipeline cuts, or the stages ``gpipe.split`` cut), its vocabulary and
longest sequence, how to read the loss and the logits from what the last stage returns, and
the weights a rank loads into the stages it holds. Its ``to_dict`` is what the run folder and
every checkpoint record, so a resumed run builds the same model with the same cuts.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe.comm.agreement import on_first_rank
from gpipe.engine import logits_of as engine_logits_of
from gpipe.models.gpt import GPTConfig, build_gpt, lm_loss
from gpipe.splitting import SplitModel, split

__all__ = [
    "MODEL_FORMS",
    "TrainModel",
    "logits_of",
    "model_from_dict",
    "parse_model",
]

MODEL_FORMS = "gpt, hf:PATH (a config.json or a Hugging Face model folder) or MODULE:FUNCTION"


def parse_model(value: str) -> tuple[str, str]:
    """``--model`` as ``(kind, target)``: ``("gpt", "")``, ``("hf", PATH)`` or
    ``("module", "MODULE:FUNCTION")``."""
    if value == "gpt":
        return "gpt", ""
    if value.startswith("hf:") and len(value) > 3:
        return "hf", value[3:]
    module, _, function = value.partition(":")
    if module and function and module.replace(".", "").replace("_", "").isalnum():
        return "module", value
    raise ValueError(f"--model must be {MODEL_FORMS}, got {value!r}")


def logits_of(outputs: Any) -> Tensor:
    """The logits in what a language model returns (``gpipe.engine.logits_of``: the tensor
    itself, a Hugging Face ``ModelOutput``'s or a dict's ``logits``), refused in
    ``gpipe train``'s words where there are none."""
    try:
        return engine_logits_of(outputs)
    except TypeError:
        raise TypeError(
            f"the model returned {type(outputs).__name__}; gpipe train expects logits "
            "[batch, tokens, vocabulary]: a tensor, or an output with a 'logits' tensor"
        ) from None


def model_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Mean cross-entropy of the next token over every position, for any model's output."""
    return lm_loss(logits_of(outputs), targets)


@dataclass
class TrainModel:
    """A model as the training job sees it; ``source`` is what ``--model`` said."""

    source: str = "gpt"
    vocab_size: int = 256
    seq_len: int = 128
    gpt: dict[str, Any] | None = None  # the GPTConfig of --model gpt
    weights: str | None = None  # a folder whose safetensors hold the starting weights
    split_at: list[str] | None = None  # where the stages of a split model begin
    hf_config: str | None = None  # the config.json a Hugging Face model is built from
    packed: bool = False  # traced to take packed documents: input_ids and position_ids

    @property
    def kind(self) -> str:
        return parse_model(self.source)[0]

    @property
    def config(self) -> GPTConfig:
        """The GPT's shape (``--model gpt`` only)."""
        assert self.gpt is not None, "only --model gpt has a GPTConfig"
        return GPTConfig.from_dict(self.gpt)

    def to_dict(self) -> dict[str, Any]:
        """What the run folder and every checkpoint record: for the GPT, its config alone
        (as runs have always recorded it)."""
        if self.kind == "gpt":
            return dict(self.gpt or {})
        return {k: v for k, v in asdict(self).items() if k != "gpt"}

    def layers(self, parts: int, seed: int, balance: str) -> nn.Sequential:
        """The model as the pipeline takes it: the GPT's layers on the meta device (each rank
        materializes its own), a Sequential from a factory, or ``parts`` split stages."""
        if self.kind == "gpt":
            return build_gpt(self.config, device="meta", init_seed=seed)
        if self.kind == "hf":
            from gpipe.training.hf.models import build_hf_meta

            model = build_hf_meta(self.hf_config or "")
        else:
            model = call_factory(self.source, seed)
            if isinstance(model, nn.Sequential) and not self.split_at:
                return model
        return self._split(model, parts, balance)

    def _split(self, model: nn.Module, parts: int, balance: str) -> SplitModel:
        """Cut ``model`` into ``parts`` stages, at the same places on every rank: where the
        run was cut before, where ``--split-at`` says, or where the first rank finds the
        balance (by time only where the weights are real: a model on meta has no times)."""
        ids = torch.zeros(2, min(self.seq_len, 16), dtype=torch.long, device=_device_of(model))
        example = self.inputs(ids)
        by = "time" if balance == "time" and not ids.is_meta else "parameters"
        if self.split_at is not None or parts == 1:
            stages = _split(model, example, at=self.split_at or [])
        elif by == "time" and dist.is_initialized() and dist.get_world_size() > 1:
            stages = _cut_by_first_rank(model, example, parts)
        else:  # by parameters, the same cut on every rank
            stages = _split(model, example, parts=parts, balance=by)
        self.split_at = list(stages.at)
        self._reference = model  # its real buffers fill the stages' unsaved ones
        return stages

    def inputs(self, ids: Tensor) -> Any:
        """What the model takes for rows of token ids: the ids, or for a split model traced
        to take packed documents, the ids and their positions (each row one document)."""
        if not self.packed or self.kind == "gpt":
            return ids
        positions = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
        return {"input_ids": ids, "position_ids": positions}

    def load_weights(self, stages: nn.Sequential, pipe: nn.Module) -> None:
        """Give the stages ``pipe`` holds their starting weights: from ``weights`` by the
        original names (as ``from_pretrained`` maps the saved ones to them), reading only this
        rank's tensors; a model whose layers were built with real weights needs nothing."""
        if not isinstance(stages, SplitModel) or self.weights is None:
            return
        from gpipe.training.hf.models import LazyWeights

        reference = getattr(self, "_reference", None)
        stages.load_original_state_dict(LazyWeights(self.weights, reference), module=pipe)


def _split(model: nn.Module, example: Any, **how: Any) -> SplitModel:
    """``gpipe.split`` with ``example`` as the model's positional input, or as its keyword
    inputs if it is a dict (packed documents)."""
    if isinstance(example, dict):
        return split(model, (), example, **how)
    return split(model, (example,), **how)


def _cut_by_first_rank(model: nn.Module, example: Any, parts: int) -> SplitModel:
    """Stages cut by measured time: the first rank measures and the others cut where it did
    (times differ between processes, and every rank must hold the same stages)."""
    measured: list[SplitModel] = []

    def measure() -> list[str]:
        measured.append(_split(model, example, parts=parts, balance="time"))
        return list(measured[0].at)

    at = on_first_rank(measure, None, "cutting the model by measured time")
    return measured[0] if measured else _split(model, example, at=at)


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def call_factory(target: str, seed: int) -> nn.Module:
    """``MODULE:FUNCTION``'s module, built with the run's seed, so every rank builds the same
    weights; MODULE is imported from the current folder or the installed packages."""
    name, _, function = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(
            f"--model {target}: cannot import {name!r} ({exc}); it must be importable from "
            "the current folder or the installed packages"
        ) from None
    factory: Callable[[], Any] | None = getattr(module, function, None)
    if not callable(factory):
        raise ValueError(f"--model {target}: {name} has no function {function!r}")
    torch.manual_seed(seed)
    built = factory()
    if not isinstance(built, nn.Module):
        raise ValueError(
            f"--model {target}: {function}() returned {type(built).__name__}, expected an "
            "nn.Module (or an nn.Sequential)"
        )
    return built


def model_from_dict(values: dict[str, Any]) -> TrainModel:
    """The inverse of ``TrainModel.to_dict``: a dict without ``source`` (or with
    ``source="gpt"``) is the GPT's config."""
    if values.get("source", "gpt") == "gpt":
        fields_ = {k: v for k, v in values.items() if k != "source"}
        config = GPTConfig.from_dict(fields_)
        return TrainModel("gpt", config.vocab_size, config.seq_len, gpt=config.to_dict())
    return TrainModel(**values)
