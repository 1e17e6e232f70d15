"""``gpipe train --config FILE.toml``: every flag as a key, the command line winning; and
``--print-config``, the resolved configuration in the same form, so that it can be saved and
given back.

Keys are the flags' long names without the dashes (``batch-size = 16``; ``batch_size`` is
taken too). A key that is no flag, or a value of the wrong type, is a one-line error that
names the file, the key and what was expected.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

from gpipe.cli.common import UsageError

__all__ = ["apply_config_file", "config_text", "resolved_config"]

_NOT_KEYS = {"help", "config", "print_config"}  # flags that make no sense in the file


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each settable flag by its key: the long name without dashes."""
    found = {}
    for action in parser._actions:  # argparse keeps its actions here, and nowhere public
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest not in _NOT_KEYS:
            found[longs[0][2:]] = action
    return found


def _checked(path: str, key: str, value: Any, action: argparse.Action) -> Any:
    """``value`` as the flag would have parsed it, or an error naming what it expects."""
    if isinstance(action, argparse._StoreTrueAction):
        expected, ok = "true or false", isinstance(value, bool)
    elif action.type in (int, float):
        number = (int,) if action.type is int else (int, float)
        expected = "an integer" if action.type is int else "a number"
        ok = isinstance(value, number) and not isinstance(value, bool)
    else:
        expected, ok = "a string", isinstance(value, str)
    if ok and action.choices is not None and value not in action.choices:
        expected, ok = f"one of {', '.join(map(str, action.choices))}", False
    if not ok:
        raise UsageError(f"--config {path}: {key} must be {expected}, got {value!r}")
    return value


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill ``args`` from ``--config``: every key whose flag was not given on the command
    line (its value is still the parser's default) takes the file's value."""
    if args.config is None:
        return
    try:
        table = tomllib.loads(Path(args.config).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"--config {args.config}: {exc}") from None
    flags = _flags(parser)
    for raw, value in table.items():
        key = raw.replace("_", "-")
        if key not in flags:
            close = difflib.get_close_matches(key, flags, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(
                f"--config {args.config}: unknown key {raw!r}{hint}; the keys are gpipe "
                "train's flags without the dashes (gpipe train --print-config lists them)"
            )
        action = flags[key]
        if getattr(args, action.dest) == parser.get_default(action.dest):
            setattr(args, action.dest, _checked(args.config, raw, value, action))


def resolved_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, model: Any, opts: Any
) -> dict[str, Any]:
    """Every flag's value as the run will use it (the model's shape and the options
    resolved, defaults filled in), by key; flags left unset are left out."""
    values = {"model": model.source, "split-at": ",".join(model.split_at or []) or None}
    if model.kind == "gpt":
        from gpipe.cli.train_model import GPT_FLAGS

        config = model.config
        values |= {f.replace("_", "-"): getattr(config, name) for f, name in GPT_FLAGS.items()}
        values["untied"] = not config.tied
    options = vars(opts)
    for key, action in _flags(parser).items():
        if key in values or action.dest in ("force", "preset"):
            continue
        if action.dest in options:
            values[key] = options[action.dest]
        elif key in ("out", "resume", "threads", "max-restarts"):
            values[key] = getattr(args, action.dest)
    return {k: v for k, v in values.items() if v is not None}


def config_text(values: dict[str, Any]) -> str:
    """``values`` as a TOML file that ``--config`` reads back (strings, numbers, booleans)."""
    return "".join(f"{key} = {_toml(value)}\n" for key, value in values.items())


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string
