"""A run's model whole in one process, read from one of its checkpoints: what ``gpipe
sample`` generates with and ``gpipe export`` writes out.

The model is built real on the CPU in float32 as the run recorded it (the GPT from its
config, a Hugging Face model from its config, a factory's module from its function), cut
where the run cut it, so the checkpoint's keys (``"0.model.embed_tokens.weight"``) are the
stages', and loaded. A split model's stages hold the model's own parameters: loading them
fills the model as it was built, which is what an export saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.models.gpt import build_gpt
from gpipe.splitting import split
from gpipe.training.checkpoints.format import (
    DESCRIPTION,
    checkpoint_dirs,
    load_model_weights,
    read_run_record,
    verify_checkpoint,
)
from gpipe.training.models.sources import TrainModel, call_factory, logits_of, model_from_dict

__all__ = [
    "TrainedModel",
    "check_code_named",
    "checkpoint_at",
    "hf_config_of",
    "load_trained",
    "trained_model",
]


def checkpoint_at(path: str | Path) -> Path:
    """The checkpoint ``path`` names: the folder itself if it is one, else the newest
    checkpoint of the run folder ``path``. ValueError, naming the file and why, if there is
    none or it does not verify (damaged, or refused as unsafe to open): an export or a sample
    is never quietly made of an older checkpoint than the one asked for."""
    folder = Path(path)
    if (folder / DESCRIPTION).is_file():
        problems = _problems(folder)
        if problems:
            raise ValueError(f"{folder}: damaged checkpoint ({'; '.join(problems)})")
        return folder
    found = checkpoint_dirs(folder / "checkpoints")
    if not found:
        raise ValueError(f"{folder}: no gpipe checkpoint there (a run folder or a checkpoint)")
    problems = _problems(found[-1])
    if problems:
        older = next((p for p in reversed(found[:-1]) if not _problems(p)), None)
        hint = f"; the newest that verifies is {older}: name it" if older else ""
        raise ValueError(f"{found[-1]}: damaged checkpoint ({'; '.join(problems)}){hint}")
    return found[-1]


def _problems(checkpoint: Path) -> list[str]:
    """``verify_checkpoint``'s, then ``_unheld_layers``'."""
    return verify_checkpoint(checkpoint, run=True) or _unheld_layers(checkpoint)


def _unheld_layers(checkpoint: Path) -> list[str]:
    """The record's balance, refused unless the checkpoint holds the weights of each layer
    it cuts and of no other: the GPT's layers, or a split model's stages, each hold some.
    ``gpipe sample`` and ``generate`` start a process for each of its stages: a record
    edited to declare thousands (with a model or cuts edited to match) would start them."""
    from gpipe.training.checkpoints.safe_reading import read_metadata

    record = read_run_record(checkpoint)
    model = model_from_dict(record["model"])
    balance = record.get("balance")
    if balance is None or model.kind == "module":
        return []  # a module of the user's own may hold layers without weights
    names = (key.split(".") for key in read_metadata(checkpoint).state_dict_metadata)
    held = {int(n[1]) for n in names if n[0] == "model" and len(n) > 2 and n[1].isdigit()}
    count = sum(balance)  # the GPT's layers, or one entry of 1 for each stage of a split
    if held == set(range(count)):
        return []
    said = f"cuts {count} layers" if model.kind == "gpt" else f"declares {count} stages"
    return [f"{DESCRIPTION}'s balance {said}, but its tensors hold the weights of {len(held)}"]


def trained_model(checkpoint: Path) -> TrainModel:
    """The model the checkpoint's run trains, as it recorded it (with its cuts)."""
    return model_from_dict(read_run_record(checkpoint)["model"])


@dataclass
class TrainedModel:
    """A run's model loaded from a checkpoint."""

    model: TrainModel
    """What the run trains, as ``--model`` said and the run recorded."""
    module: nn.Module
    """Token ids ``[batch, tokens]`` to the model's outputs: the GPT, a factory's
    Sequential, or the stages the run cut (a ``SplitModel``)."""
    original: nn.Module
    """The model as it was built, holding the loaded weights (``module`` itself unless the
    run split it)."""
    checkpoint: Path
    train: dict[str, Any]
    """The run's options as the checkpoint recorded them (``TrainOptions`` as a dict)."""

    @property
    def step(self) -> int:
        return int(read_run_record(self.checkpoint)["step"])

    @property
    def seq_len(self) -> int:
        """The longest window the run trained on."""
        return int(self.train.get("seq_len") or self.model.seq_len)

    def logits(self, ids: Tensor) -> Tensor:
        """The logits ``[batch, tokens, vocabulary]`` of token ids ``[batch, tokens]``."""
        return logits_of(self.module(ids))


def hf_config_of(model: TrainModel) -> Path:
    """The config.json a Hugging Face run was built from: where the run found it, else the
    copy beside its starting weights (the run folder's ``initial``, or the fine-tuned
    folder)."""
    candidates = [Path(model.hf_config or "")]
    if model.weights is not None:
        candidates.append(Path(model.weights) / "config.json")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"--model {model.source}: its config is gone ({' and '.join(map(str, candidates))} "
        "do not exist); put the config.json back where the run read it"
    )


def check_code_named(model: TrainModel, where: Path, given: str | None) -> None:
    """A run of ``--model MODULE:FUNCTION`` names code to import and call; a run folder may
    come from anyone, so that code runs only when the user names it too (``given``)."""
    if model.kind == "module" and given != model.source:
        raise ValueError(
            f"{where} names code to run, --model {model.source}; gpipe runs a run folder's "
            f"code only when you name it: pass --model {model.source}"
        )


def load_trained(checkpoint: Path, *, code: str | None = None) -> TrainedModel:
    """The run's model, built on the CPU in float32 and loaded from ``checkpoint``, in
    evaluation mode. A run of a module of the user's own is built only when ``code`` names
    the same ``MODULE:FUNCTION`` (``check_code_named``)."""
    description = read_run_record(checkpoint)
    model = model_from_dict(description["model"])
    check_code_named(model, checkpoint / DESCRIPTION, code)
    train = dict(description.get("train") or {})
    original = _build(model, int(train.get("seed", 0)))
    original.eval()
    module = original
    if model.kind != "gpt" and (model.split_at or not isinstance(original, nn.Sequential)):
        example = torch.zeros(2, min(model.seq_len, 16), dtype=torch.long)
        module = split(original, (example,), at=model.split_at or [])
        module.eval()
    load_model_weights(checkpoint, module)
    return TrainedModel(model, module, original, checkpoint, train)


def _build(model: TrainModel, seed: int) -> nn.Module:
    """The model with real weights on the CPU, for a checkpoint to overwrite."""
    if model.kind == "gpt":
        return build_gpt(model.config)
    if model.kind == "hf":
        from gpipe.training.hf.models import build_hf_zeros

        return build_hf_zeros(hf_config_of(model))
    return call_factory(model.source, seed)
