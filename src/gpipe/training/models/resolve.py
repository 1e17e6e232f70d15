"""The model a run trains (``TrainConfig.model`` and the GPT's shape fields), resolved from
the configuration or from the run it continues, and checked before any process starts."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpipe.errors import ConfigError, first_line
from gpipe.training.config import TrainConfig

if TYPE_CHECKING:
    from gpipe.training.models.sources import TrainModel
    from gpipe.training.options import TrainOptions

__all__ = [
    "GPT_FLAGS",
    "check_pack",
    "longest_sequence",
    "model_layer_count",
    "quiet_tracer",
    "resolve_model",
    "starting_weights",
]

GPT_FLAGS = {  # flag -> GPTConfig field
    "n_layer": "n_layer",
    "d_model": "d_model",
    "n_head": "n_head",
    "d_ff": "d_ff",
    "context": "seq_len",
    "dropout": "dropout",
}


def resolve_model(config: TrainConfig, saved: dict[str, Any] | None, out: Path) -> TrainModel:
    """The run's ``TrainModel``: from ``--model`` and its flags, or as the run in ``out``
    recorded it (where the flags must agree with it)."""
    from gpipe.training.models.sources import model_from_dict, parse_model

    try:
        kind, target = parse_model(config.model or (saved or {}).get("source", "gpt"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    given = [f"--{f.replace('_', '-')}" for f in GPT_FLAGS if getattr(config, f) is not None]
    given += ["--untied"] * bool(config.untied) + ["--preset"] * (config.preset is not None)
    if kind != "gpt" and given:
        raise ConfigError(
            f"{', '.join(given)}: the built-in GPT's flags, but --model {config.model} gives the "
            "model; set its shape in its own config or factory"
        )
    if kind == "gpt":
        return model_from_dict({"source": "gpt", **_gpt_fields(config, saved, out)})
    if saved is not None:
        held = model_from_dict(saved)
        if config.model is not None and config.model != held.source:
            raise ConfigError(f"the run in {out} trains --model {held.source}, not {config.model}")
        from gpipe.training.models.trained import check_code_named

        try:
            check_code_named(held, out / "run.json", config.model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return held
    split_at = config.split_at.split(",") if config.split_at else None
    try:
        if kind == "hf":
            return _hf_model(target, split_at)
        return _module_model(target, split_at, config.seq_len)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _gpt_fields(config: TrainConfig, saved: dict[str, Any] | None, out: Path) -> dict[str, Any]:
    from gpipe.models.gpt import GPTConfig, config_from_preset

    if config.split_at:
        raise ConfigError("--split-at cuts a model given by --model hf:... or MODULE:FUNCTION")
    overrides = {
        field_: getattr(config, flag)
        for flag, field_ in GPT_FLAGS.items()
        if getattr(config, flag) is not None
    }
    if config.untied:
        overrides["tied"] = False
    try:
        if saved is None:
            gpt = config_from_preset(config.preset or "small", **overrides)
        else:
            gpt = GPTConfig.from_dict({k: v for k, v in saved.items() if k != "source"})
    except (ValueError, KeyError, TypeError) as exc:
        message = str(exc).strip("'\"")
        raise ConfigError(message if saved is not None else _in_flags(message)) from None
    differ = {k: v for k, v in overrides.items() if getattr(gpt, k) != v}
    if differ:
        asked = ", ".join(f"{k}={v}" for k, v in differ.items())
        held = ", ".join(f"{k}={getattr(gpt, k)}" for k in differ)
        raise ConfigError(f"the checkpoint in {out} holds a model with {held}, not {asked}")
    return gpt.to_dict()


def _in_flags(message: str) -> str:
    """``GPTConfig``'s refusal of a shape the flags asked for, in the flags' names
    (``GPTConfig.seq_len`` is ``--context``)."""
    for flag, field_ in GPT_FLAGS.items():
        message = re.sub(rf"\b(GPTConfig\.)?{field_}\b", "--" + flag.replace("_", "-"), message)
    return message


def _hf_model(target: str, split_at: list[str] | None) -> TrainModel:
    from gpipe.training.hf.models import LazyWeights, config_file, hf_config
    from gpipe.training.models.sources import TrainModel

    config = hf_config(target)
    folder = config_file(target).parent
    has_weights = any((folder / n).is_file() for n in ("model.safetensors", _INDEX))
    if Path(target).is_dir() and has_weights:
        try:  # the index and every file's header, here rather than in each stage process
            LazyWeights(folder)
        except Exception as exc:  # a damaged file's error is whatever safetensors met
            raise ConfigError(
                f"--model hf:{target}: its weights cannot be read ({first_line(exc)})"
            ) from None
    return TrainModel(
        source=f"hf:{target}",
        vocab_size=int(config.vocab_size),
        seq_len=int(getattr(config, "max_position_embeddings", 0) or 2048),
        weights=str(folder.resolve()) if Path(target).is_dir() and has_weights else None,
        split_at=split_at,
        hf_config=str(config_file(target).resolve()),
    )


_INDEX = "model.safetensors.index.json"


def _module_model(target: str, split_at: list[str] | None, seq_len: int | None) -> TrainModel:
    """A factory's model, built once here to learn its vocabulary (the logits' width, on the
    meta device) and its longest sequence (``max_seq_len``, ``seq_len`` or its config's
    ``max_position_embeddings``; else ``--seq-len``)."""
    from gpipe.training.models.sources import TrainModel, call_factory, logits_of

    model = call_factory(target, 0)
    longest = longest_sequence(model) or seq_len
    if longest is None:
        raise ValueError(
            f"--model {target}: its longest sequence is unknown (no max_seq_len, seq_len or "
            "config.max_position_embeddings attribute); pass --seq-len"
        )
    probe = model.to("meta")
    if not isinstance(model, nn.Sequential) or split_at:
        _check_traceable(probe, target, split_at)
    try:
        with torch.no_grad():
            vocab = logits_of(probe(torch.zeros(2, 4, dtype=torch.long, device="meta"))).shape[-1]
    except (TypeError, RuntimeError) as exc:
        raise ValueError(
            f"--model {target}: the model must take token ids [batch, tokens] and return "
            f"logits [batch, tokens, vocabulary] ({exc})"
        ) from None
    return TrainModel(source=target, vocab_size=int(vocab), seq_len=int(longest), split_at=split_at)


def _check_traceable(model: nn.Module, target: str, split_at: list[str] | None) -> None:
    """Trace the model (on meta: no memory, no compute) before any process starts, so an
    untraceable one, or a wrong --split-at, is gpipe.split's one-line error here."""
    from gpipe.splitting import split

    example = torch.zeros(2, 4, dtype=torch.long, device="meta")
    try:  # the tracer prints the graph it gave up on, and logs: the message says it all
        with quiet_tracer():
            split(model, (example,), at=split_at or [])
    except Exception as exc:  # TraceError, CutError, or the tracer's own
        raise ValueError(f"--model {target}: {first_line(exc)}") from None


def longest_sequence(model: nn.Module) -> int | None:
    """A module's ``max_seq_len`` or ``seq_len``, or its config's ``max_position_embeddings``."""
    for name in ("max_seq_len", "seq_len"):
        if isinstance(getattr(model, name, None), int):
            return int(getattr(model, name))
    found = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(found) if isinstance(found, int) else None


def model_layer_count(model: TrainModel) -> int | None:
    """Layers the pipeline cuts between (``--stages`` can be at most that), where known
    before the ranks build the model: the GPT's blocks, embedding and head; a Hugging Face
    model's decoder layers where it declares a pipeline plan (a stage holds one at least)."""
    if model.kind == "gpt":
        return model.config.n_layer + 2
    if model.kind == "hf" and model.hf_config is not None:
        from gpipe.training.hf.models import hf_config

        config = hf_config(model.hf_config)
        if getattr(config, "base_model_pp_plan", None):
            layers = getattr(config, "num_hidden_layers", None)
            return int(layers) if isinstance(layers, int) else None
    return None


def starting_weights(model: TrainModel, seed: int) -> None:
    """A Hugging Face model built from a config alone starts from random weights drawn
    once, by the process that prepares the run folder, and saved there (``model.weights``):
    every rank reads its own stage's from them."""
    if model.kind != "hf" or model.weights is None or Path(model.weights).is_dir():
        return
    from gpipe.training.hf.models import write_initial_weights

    assert model.hf_config is not None  # an hf: model names the config it is built from
    write_initial_weights(model.hf_config, Path(model.weights), seed)


@contextlib.contextmanager
def quiet_tracer() -> Iterator[None]:
    """torch.export prints the graph it gave up on, and logs: the error says it all."""
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        torch_log.setLevel(level)


def check_pack(opts: TrainOptions, model: TrainModel) -> None:
    """``--pack`` needs documents, a model that knows where they begin, and a named
    schedule; a Hugging Face model is then marked to be traced with ``position_ids``
    (``TrainModel.packed``), which the run records."""
    if not opts.pack:
        return
    for flag, path in (("--data", opts.data), ("--val-data", opts.val_data)):
        if (path is not None or flag == "--data") and not str(path).lower().endswith(".jsonl"):
            raise ConfigError(
                f"--pack trains on documents: {flag} must be a JSON lines file (.jsonl, one "
                f'object with a "text" field per document), got {path}'
            )
    if model.kind == "module":
        raise ConfigError(
            f"--pack with --model {model.source}: gpipe cannot know how your model takes "
            "document boundaries; use --model gpt or hf:PATH, or gpipe.data.pack with "
            "Pipeline.step(microbatches=...) in your own loop (docs/varlen.md)"
        )
    if opts.schedule == "auto":
        raise ConfigError(
            "--pack with --schedule auto: auto times micro-batches of one shape, and packed "
            "ones differ; name a schedule (gpipe plan --suggest can help choose)"
        )
    if opts.chunks is not None and opts.batch_size < opts.chunks * opts.data_parallel:
        raise ConfigError(
            f"--pack: --batch-size {opts.batch_size} rows' worth of tokens cannot fill --chunks "
            f"{opts.chunks} x --data-parallel {opts.data_parallel} micro-batches; raise "
            "--batch-size or lower --chunks"
        )
    if model.kind == "hf":
        _check_packed_masks(model.source)
    model.packed = model.kind == "hf"


def _check_packed_masks(source: str) -> None:
    """A Hugging Face model keeps packed documents apart only where transformers builds its
    document mask from ``position_ids`` that restart (``find_packed_sequence_indices``)."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import transformers

        raise ConfigError(
            f"--pack with --model {source}: transformers {transformers.__version__} does not "
            "build document masks from position_ids, so packed documents would attend to "
            "each other; upgrade transformers"
        ) from None
