"""The ``gpipe`` command: ``gpipe train`` trains a model through the pipeline, ``gpipe sample``
generates from its checkpoints (``gpipe generate``: a file of prompts, through the run's
stages) and ``gpipe export`` writes it out for Hugging Face;
``gpipe simulate`` and ``gpipe plan`` predict time and memory without running; ``gpipe
bench`` measures them against other tools; ``gpipe view`` writes a page that plays a schedule.

One module per command, each adding its parser to ``main``'s; what they share lives in
``common``, below them all."""

from __future__ import annotations

import contextlib
import os
import sys

from gpipe.cli import bench, export, generate, plan, sample, simulate, train, view
from gpipe.cli.common import Parser, UsageError
from gpipe.errors import ConfigError, PipelineError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="gpipe", description="Pipeline-parallel training on PyTorch.")
    sub = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for command in (train, sample, generate, export, simulate, plan, bench, view):
        command.add_parser(sub)
    try:
        args = parser.parse_args(argv)
        code = args.command(args)
        sys.stdout.flush()  # here, where a reader that went away is caught below
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (UsageError, ConfigError) as exc:
        print(f"gpipe: error: {exc}", file=sys.stderr)
        return 2
    except PipelineError as exc:
        print(f"gpipe: failed: {exc}", file=sys.stderr)
        interrupted = getattr(exc, "signal", None)  # a launch that Ctrl-C or SIGTERM stopped
        return 128 + interrupted if interrupted else 1  # as a shell reports a signal


def _reader_gone() -> int:
    """What reads the output stopped (``gpipe plan ... | head``): end quietly, as a Unix
    command does, with the status of SIGPIPE. Standard output now goes nowhere, so that
    Python's own flush at exit does not fail on the closed pipe again."""
    with contextlib.suppress(OSError, ValueError):  # no file behind it: nothing to flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
