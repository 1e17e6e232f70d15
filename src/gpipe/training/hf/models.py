"""Hugging Face causal language models in ``gpipe train``: read a config, build the model
without its weights, read each rank's weights lazily, and write a trained run back out.

``transformers`` is an optional extra; it is imported here only, and its absence is a
one-line error that names the extra.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gpipe.errors import ConfigError, first_line
from gpipe.training.hf.loaded_names import Merged, names_as_loaded

__all__ = [
    "LazyWeights",
    "build_hf_meta",
    "build_hf_zeros",
    "hf_config",
    "write_initial_weights",
]

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "--model hf: needs Hugging Face transformers: pip install 'gpipe-parallel[hf]'"
        ) from None
    return transformers


def config_file(path: str | Path) -> Path:
    """The ``config.json`` that ``path`` names: the file itself, or the one in a folder."""
    path = Path(path)
    found = path / "config.json" if path.is_dir() else path
    if not found.is_file():
        raise ValueError(f"--model hf:{path}: no config.json there")
    return found


def hf_config(path: str | Path) -> Any:
    """The model config at ``path``, refused unless it describes a causal language model."""
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    file = config_file(path)
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(file), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # a malformed file's error is whatever its reader met
        raise ValueError(
            f"--model hf:{path}: not a Hugging Face config ({first_line(exc)})"
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"--model hf:{path}: a {config.model_type!r} config is not a causal language model "
            "(AutoModelForCausalLM has no class for it); give the config of a decoder such as "
            "Llama, Qwen, Mistral or GPT-2"
        )
    config.use_cache = False  # training: no key/value cache in the traced graph
    return config


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules whose parameters take no memory while their buffers are real: buffers
    that no checkpoint holds (a rotary embedding's frequencies) are computed as usual."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]  # for the build only
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]  # put back


def _model_of(config: Any, path: str | Path) -> Any:
    """``AutoModelForCausalLM``'s model of ``config`` in float32; a config its class cannot
    build (a ``pad_token_id`` beyond the vocabulary, say) is refused in one line naming it,
    before any process starts, rather than with the class's own traceback."""
    try:
        return _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (AssertionError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise ConfigError(
            f"--model hf:{path}: its config does not build a model "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from None


def build_hf_meta(path: str | Path) -> nn.Module:
    """The model of the config at ``path`` in float32, parameters on the meta device."""
    config = hf_config(path)
    with _parameters_on_meta():
        model = _model_of(config, path)
    return model.train()


def build_hf_zeros(path: str | Path) -> nn.Module:
    """The model of the config at ``path`` in float32 on the CPU, every parameter zeros for a
    checkpoint to fill: nothing drawn at random, so a large model builds in the time its
    memory takes to fill. Tied parameters stay one parameter."""
    model = build_hf_meta(path)
    real: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in real:
                    zeros = torch.zeros(param.shape, dtype=param.dtype)
                    real[id(param)] = nn.Parameter(zeros, requires_grad=param.requires_grad)
                module._parameters[name] = real[id(param)]
    return model


def write_initial_weights(path: str | Path, out: Path, seed: int) -> Path:
    """Build the model of the config at ``path`` once, with random weights from ``seed``, and
    save it as a Hugging Face folder under ``out`` that every rank then reads its own
    tensors from; returns the folder (written whole or not at all).

    The tensors keep the names of the model's own state dict, each shared tensor once (a
    tied head is its embedding): ``save_pretrained`` would write a mixture of experts'
    stacked experts one expert at a time, a layout that cannot be read tensor by tensor."""
    from safetensors.torch import save_file

    config = hf_config(path)
    torch.manual_seed(seed)
    model = _model_of(config, path)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.config.save_pretrained(str(partial))
    save_file(_each_tensor_once(model.state_dict()), str(partial / _WEIGHTS), {"format": "pt"})
    os.replace(partial, out)
    return out


def _each_tensor_once(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` without the later names of a tensor that an earlier name holds too."""
    kept: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        offset = int(tensor.storage_offset())
        place = (tensor.untyped_storage().data_ptr(), offset, tuple(tensor.shape))
        if place not in seen:
            seen.add(place)
            kept[name] = tensor.contiguous()
    return kept


class LazyWeights(Mapping[str, Tensor]):
    """The tensors of a Hugging Face folder's safetensors, each read only when asked for: a
    rank reads its own stage's weights and nothing else.

    With ``model``, a tensor goes by the name ``from_pretrained`` loads it into ``model``
    under (``names_as_loaded``: GPT-NeoX saves its ``lm_head`` as ``embed_out``), and a
    mixture of experts saved one expert a tensor is read stacked, as the model holds it;
    without one, by the name it is saved under."""

    def __init__(self, folder: str | Path, model: nn.Module | None = None) -> None:
        from safetensors import safe_open

        folder = Path(folder)
        if (folder / _INDEX).is_file():
            files = _weight_map(folder / _INDEX)
        elif (folder / _WEIGHTS).is_file():
            files = None
        else:
            raise ValueError(f"{folder}: no {_WEIGHTS} or {_INDEX} to read weights from")
        names = sorted(set(files.values())) if files else [_WEIGHTS]
        self._open = {name: safe_open(str(folder / name), "pt") for name in names}
        saved = files or {k: _WEIGHTS for k in self._open[_WEIGHTS].keys()}  # noqa: SIM118
        loaded: dict[str, str] = {key: key for key in saved}
        self._merged: dict[str, Merged] = {}
        if model is not None:
            loaded, self._merged = names_as_loaded(model, saved, folder)
        self._file = saved
        self._where = {name: (saved[key], key) for key, name in loaded.items()}

    def __contains__(self, key: object) -> bool:
        return key in self._where or key in self._merged

    def __getitem__(self, key: str) -> Tensor:
        merged = self._merged.get(key)
        if merged is not None:
            return merged.build(self._saved)
        file, saved = self._where[key]
        return self._open[file].get_tensor(saved)

    def _saved(self, key: str) -> Tensor:
        """A tensor by the name it is saved under."""
        return self._open[self._file[key]].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        yield from self._where
        yield from self._merged

    def __len__(self) -> int:
        return len(self._where) + len(self._merged)


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded folder's map from tensor name to the safetensors file holding it, each a
    file of the folder itself."""
    try:
        files = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a safetensors index ({exc})") from None
    if not isinstance(files, dict) or not all(
        isinstance(k, str)
        and isinstance(v, str)
        and Path(v).name == v
        and v.endswith(".safetensors")
        for k, v in files.items()
    ):
        raise ValueError(f"{index}: its weight_map must name .safetensors files of its folder")
    return files
