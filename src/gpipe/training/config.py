"""What a run asks for: ``TrainConfig``, the flags of ``gpipe train`` as a typed dataclass, and
its TOML form (``--config`` reads it, ``--print-config`` writes it).

A field left ``None`` means "the default, or the run's own when it is resumed": a resumed run
keeps what it was started with unless the configuration says otherwise. ``resolve``
(``training/run.py``) turns a configuration (and the run it continues) into the
``TrainOptions`` every rank runs with; the rules those options must satisfy are
``check_options``'s (``training/rules.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpipe.errors import ConfigError
from gpipe.training.run_record import check_fields, dataclass_types
from gpipe.training.trackers import report_to_names

__all__ = [
    "CHOICES",
    "TrainConfig",
    "config_text",
    "config_values",
    "read_config_file",
    "with_flags",
]

CHOICES: dict[str, tuple[str, ...]] = {
    "shard": ("none", "optimizer", "gradients", "full"),
    "device": ("cpu", "cuda"),
    "precision": ("fp32", "bf16", "fp16"),
    "save_writer": ("auto", "process", "thread"),
    "token_dtype": ("uint16", "uint32"),
    "seq_split": ("even", "balanced"),
}


@dataclass(kw_only=True)
class TrainConfig:
    """A run of ``gpipe train``, field for flag (``--batch-size`` is ``batch_size``), given
    by keyword; ``gpipe.training.train(config)`` runs it as the command would. ``None``: the
    default, or the resumed run's own."""

    # the model
    model: str | None = None  # gpt, hf:PATH or MODULE:FUNCTION (default gpt)
    split_at: str | None = None  # NAME,... where a traced model's stages begin
    preset: str | None = None  # the GPT's named size (default small)
    n_layer: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    d_ff: int | None = None
    context: int | None = None  # the GPT's longest sequence
    dropout: float | None = None
    untied: bool = False  # separate embedding and LM-head weights
    # the pipeline
    stages: int | None = None
    data_parallel: int | None = None
    tensor_parallel: int | None = None
    shard: str | None = None
    chunks: int | None = None
    checkpoint: str | None = None  # re-materialization: always, except_last, never
    schedule: str | None = None
    virtual_stages: int | None = None
    balance: str | None = None
    device: str | None = None
    precision: str | None = None
    threads: int | None = None  # intra-op threads per process on CPU
    # training
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    warmup: int | None = None
    eval_every: int | None = None
    save_every: int | None = None
    keep: int | None = None
    keep_every: int | None = None
    sync_save: bool = False
    save_writer: str | None = None
    data: str | None = None
    val_data: str | None = None
    tokenizer: str | None = None
    token_dtype: str | None = None
    pack: bool = False
    seed: int | None = None
    timeout: float | None = None
    max_restarts: int | None = None
    prompt: str | None = None
    sample_tokens: int | None = None
    # the run folder
    out: str = "runs/gpt"
    resume: str | None = None  # continue the run in this folder
    force: bool = False  # replace what is in the run folder
    quiet: bool = False  # plain log lines, no progress bar
    report_to: str | None = None  # none, or tensorboard and/or wandb, comma-separated
    trace: bool = False  # write the last step's timeline into the run folder
    compile: bool = False  # each layer compiled with torch.compile
    compile_backend: str | None = None  # torch.compile's backend (default inductor)
    seq_chunks: int | None = None  # sub-sequences per micro-batch (Seq1F1B; default 1)
    seq_split: str | None = None  # even, or balanced (equal cost)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ConfigError naming the first field whose value is not of its type or not among
        its choices: at construction, and again when the configuration is run, since a
        field may have been set since (``config.steps = "ten"``)."""
        try:
            check_fields(dataclasses.asdict(self), dataclass_types(TrainConfig), "TrainConfig")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.report_to is not None:
            report_to_names(self.report_to)
        if not self.out:
            raise ConfigError("--out must name a run folder, got ''")

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "TrainConfig") -> TrainConfig:
        """A configuration from ``values`` (keys with dashes or underscores); an unknown key
        is named, with the nearest known one."""
        known = [f.name for f in dataclasses.fields(cls)]
        fields_: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        prefix = f"{where}: " if where else ""
        for raw, value in values.items():
            key = raw.replace("-", "_")
            if key in spelled:
                raise ConfigError(
                    f"{prefix}{spelled[key]!r} and {raw!r} are the same key, given twice; "
                    "keep one of them"
                )
            spelled[key] = raw
            if key not in known:
                close = difflib.get_close_matches(key.replace("_", "-"), _flags(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(
                    f"{prefix}unknown key {raw!r}{hint}; the keys are gpipe train's flags "
                    "without the dashes (gpipe train --print-config lists them)"
                )
            fields_[key] = value
        try:
            return cls(**fields_)
        except ValueError as exc:
            named = str(exc).startswith(f"{where}.")  # TrainConfig.steps is ...: named already
            raise ConfigError(f"{'' if named else prefix}{exc}") from None

    def given(self) -> dict[str, Any]:
        """The fields set to something other than their default."""
        defaults = TrainConfig()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }


# What describes the model beside --model: a file's values for them belong to its model.
_MODEL_SHAPE = ("preset", "n_layer", "d_model", "n_head", "d_ff", "context", "dropout", "untied")


def with_flags(file: TrainConfig, flags: dict[str, Any]) -> TrainConfig:
    """A ``--config`` file's configuration with the command line's ``flags`` on top: a flag
    given wins, even where it says what the default says. A flag that names another model
    (a ``--preset`` or a ``--model`` other than the file's) replaces the file's model whole:
    the shape the file gives (as ``--print-config`` writes it) and its ``--split-at`` were
    the other model's, and would otherwise override the preset asked for. A ``--resume``
    replaces the file's ``out``: the run goes on in its own folder."""
    values = file.given()
    if "resume" in flags:  # the run goes on in its own folder, wherever the file's went
        values.pop("out", None)
    other_preset = "preset" in flags and flags["preset"] != file.preset
    other_model = "model" in flags and flags["model"] != (file.model or "gpt")
    if other_preset or other_model:
        dropped = (*_MODEL_SHAPE, "split_at") if other_model else _MODEL_SHAPE
        values = {k: v for k, v in values.items() if k not in dropped}
    return TrainConfig.from_dict(values | flags, where="")


def _flags(names: list[str]) -> list[str]:
    return [name.replace("_", "-") for name in names]


def read_config_file(path: str | Path) -> TrainConfig:
    """The configuration a TOML file holds (``batch-size = 16``; ``batch_size`` is taken
    too); ConfigError naming the file and the key for anything else."""
    try:
        text = Path(path).read_text(encoding="utf-8")  # TOML is UTF-8, whatever the locale
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file; expected a TOML file") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path} is a folder; expected a TOML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"--config {path} is not TOML ({exc}); expected lines such as batch-size = 16"
        ) from None
    types = dataclass_types(TrainConfig)
    for raw, value in table.items():
        key = raw.replace("-", "_")
        if key in types:
            try:
                check_fields({key: value}, types, "")
            except ValueError:
                raise ConfigError(
                    f"--config {path}: {raw} must be {_expected(types[key])}, got {value!r}"
                ) from None
    return TrainConfig.from_dict(table, where=f"--config {path}")


def _expected(hint: Any) -> str:
    text = str(hint)
    if "bool" in text:
        return "true or false"
    if "int" in text:
        return "an integer"
    if "float" in text:
        return "a number"
    return "a string"


def config_values(config: TrainConfig) -> dict[str, Any]:
    """Every field of ``config`` that is set, by its flag's name (``batch-size``), as the
    run folder records it; ``force`` is an instruction, not part of a run."""
    return {
        field.name.replace("_", "-"): getattr(config, field.name)
        for field in dataclasses.fields(config)
        if getattr(config, field.name) is not None and field.name != "force"
    }


def config_text(config: TrainConfig) -> str:
    """``config`` as a TOML file that ``--config`` reads back (``config_values``' keys)."""
    return "".join(f"{key} = {_toml(value)}\n" for key, value in config_values(config).items())


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # A JSON string is a TOML basic string, save that TOML refuses the surrogate pairs JSON
    # escapes characters beyond U+FFFF into (so they are written as they are) and a raw DEL.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
