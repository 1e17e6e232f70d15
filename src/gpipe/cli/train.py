"""``gpipe train``: the flags, parsed into a ``TrainConfig`` (a ``--config`` file's values
where a flag is not given) and handed to ``gpipe.training.train``, which runs it."""

from __future__ import annotations

import argparse
from typing import Any

from gpipe.cli.train_flags import (
    add_model_options,
    add_pipeline_options,
    add_run_folder_options,
    add_training_options,
)
from gpipe.training.config import TrainConfig, config_text, read_config_file, with_flags

__all__ = ["add_parser", "config_of"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train a model, pipelined over several processes",
        description="Train a language model split into pipeline stages: the built-in "
        "GPT-style byte-level model, a Hugging Face causal LM (--model hf:PATH) or your own "
        "(--model MODULE:FUNCTION). With no arguments: the GPT's 'small' preset on the Python "
        "standard library's sources, 2 stages in 2 local processes, GPipe schedule, "
        "8 micro-batches.",
    )
    add_model_options(p.add_argument_group("model"))
    add_pipeline_options(p.add_argument_group("pipeline"))
    add_training_options(p.add_argument_group("training"))
    add_run_folder_options(p.add_argument_group("run folder"))
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="flags as keys of a TOML file (batch-size = 16); flags given here win, and a "
        "--preset or another --model given here replaces the file's model and its shape",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration, as a file --config reads, and stop",
    )
    p.set_defaults(command=_train)


def config_of(args: argparse.Namespace) -> TrainConfig:
    """The configuration the command line asks for: the flags given, and for the others a
    ``--config`` file's values (or the defaults), as ``with_flags`` puts them together."""
    flags = {
        k: v
        for k, v in vars(args).items()
        if k in TrainConfig.__dataclass_fields__ and v is not None and v is not False
    }
    if args.config is None:
        return TrainConfig.from_dict(flags, where="")
    return with_flags(read_config_file(args.config), flags)


def _train(args: argparse.Namespace) -> int:
    from gpipe.training.run import resolve, train

    config = config_of(args)
    if args.print_config:
        print(config_text(resolve(config).config), end="")
        return 0
    train(config)
    return 0
