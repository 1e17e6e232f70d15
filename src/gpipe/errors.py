"""The exceptions gpipe raises, so callers can catch pipeline failures precisely, and how
another library's exception, or a count, is told in gpipe's one-line messages."""

from __future__ import annotations

__all__ = [
    "BalanceError",
    "ConfigError",
    "MovingDenied",
    "PipelineError",
    "StageError",
    "first_line",
    "counted",
]


class PipelineError(RuntimeError):
    """A pipeline step could not complete."""


class StageError(PipelineError):
    """A stage failed, or timed out waiting for a peer stage; the message names the stage."""

    def __init__(self, stage: int, message: str) -> None:
        super().__init__(f"stage {stage}: {message}")
        self.stage = stage


class BalanceError(ValueError):
    """``balance`` does not describe a partition of the model's layers."""


class MovingDenied(TypeError):
    """Device placement of a pipelined model is fixed by its ``devices``."""


class ConfigError(ValueError):
    """A run's configuration (``TrainConfig``, the flags and config file of ``gpipe train``,
    or the run it continues) cannot be run; the message names what was given and what is
    expected, in one line."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name where it says nothing): what a
    one-line refusal quotes of an error a reader or tracer met."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def counted(count: int, word: str, suffix: str = "s") -> str:
    """``count`` of ``word``: ``1 process``, ``2 processes`` (with ``suffix="es"``), so that a
    message about one process, stage or group reads right."""
    return f"{count} {word if count == 1 else word + suffix}"
