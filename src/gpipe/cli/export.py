"""``gpipe export``: a run's trained model written out for other tools (``--hf``: a Hugging
Face folder, for runs trained with ``--model hf:...``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpipe.cli.common import UsageError

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's model as a Hugging Face folder",
        description="Write the model of a run trained with --model hf:... (its newest "
        "checkpoint, which must verify, or the checkpoint named) as a Hugging Face folder: "
        "config.json, safetensors weights and the run's tokenizer, which "
        "AutoModelForCausalLM.from_pretrained loads.",
    )
    p.add_argument("path", metavar="RUN", help="run folder or checkpoint folder")
    p.add_argument("--hf", metavar="OUT", required=True, help="the Hugging Face folder to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it is not empty")
    p.set_defaults(command=_export)


def _export(args: argparse.Namespace) -> int:
    from gpipe.training.hf.export import export_hf
    from gpipe.training.models.trained import checkpoint_at

    try:
        checkpoint = checkpoint_at(args.path)
        exported = export_hf(checkpoint, Path(args.hf), force=args.force)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tokenizer = f", tokenizer {', '.join(exported.tokenizer)}" if exported.tokenizer else ""
    print(
        f"wrote {exported.folder}: {exported.model_type} at step {exported.step} of "
        f"{checkpoint.parent.parent}{tokenizer}"
    )
    return 0
