"""``gpipe export --hf``: a run trained with ``--model hf:...`` back out as a Hugging Face
folder (``save_pretrained``'s layout: config.json and safetensors weights, and the run's
tokenizer), which ``AutoModelForCausalLM.from_pretrained`` loads with the trained weights.

The folder is written beside its destination under a temporary name and renamed into
place: it is there whole or not at all.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from gpipe.training.data.tokenizer import load_tokenizer
from gpipe.training.models.trained import hf_config_of, load_trained, trained_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Exported", "export_hf", "tokenizer_files"]

# The files of a Hugging Face tokenizer folder, by the start of their names (a model
# folder given as the tokenizer also holds a config and weights, which are not copied).
_TOKENIZER_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "chat_template",
    "spiece",
    "sentencepiece",
)


@dataclass
class Exported:
    """What ``export_hf`` wrote."""

    folder: Path
    step: int
    model_type: str
    tokenizer: list[str]
    """The names of the tokenizer files copied into the folder (none for a run on bytes)."""


def export_hf(checkpoint: Path, out: Path, *, force: bool = False) -> Exported:
    """Write the model of ``checkpoint`` (of a run trained with ``--model hf:...``) as a
    Hugging Face folder at ``out``, in float32, with the run's ``--tokenizer`` files if it had
    one. An existing ``out`` that is not empty is refused unless ``force``, and then
    replaced whole. ValueError for a run of another model or a destination it cannot use."""
    model = trained_model(checkpoint)
    if model.kind != "hf":
        what = (
            "the built-in GPT (--model gpt)"
            if model.kind == "gpt"
            else f"--model {model.source}, a module of your own"
        )
        raise ValueError(
            f"{checkpoint}: the run trains {what}, not a Hugging Face model, so there is "
            "nothing to export to Hugging Face; gpipe export --hf takes runs trained with "
            "--model hf:..."
        )
    _check_destination(out, force)
    trained = load_trained(checkpoint)
    tokenizer = (
        tokenizer_files(trained.train["tokenizer"]) if trained.train.get("tokenizer") else {}
    )
    original = cast("PreTrainedModel", trained.original)  # an hf: model, as checked above
    original.config.use_cache = _recorded_use_cache(hf_config_of(model))
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    _save_quietly(original, partial)
    for name, file in tokenizer.items():
        shutil.copyfile(file, partial / name)
    _replace(partial, out)
    return Exported(out, trained.step, str(original.config.model_type), sorted(tokenizer))


def tokenizer_files(path: str | Path) -> dict[str, Path]:
    """The files a Hugging Face folder needs of the tokenizer at ``path`` (a
    ``tokenizer.json``, or a Hugging Face tokenizer folder), by their names there. The path
    comes from the run's record, so it is read as a tokenizer first: a record that names any
    other file (a key, a password file) is refused rather than copied into the export."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"the run's --tokenizer {path} is gone; put it back to export it")
    load_tokenizer(path)  # a ValueError in one line if it is not a tokenizer
    if path.is_file():
        return {"tokenizer.json": path}
    files = {
        file.name: file
        for file in path.iterdir()
        if file.is_file()
        and (file.name.startswith(_TOKENIZER_PREFIXES) or file.suffix == ".tiktoken")
    }
    for file in files.values():
        _check_own_file(file, path)
    return files


def _check_own_file(file: Path, folder: Path) -> None:
    """ValueError unless ``file`` of the tokenizer ``folder`` is the folder's own: a link
    may point only inside it, or, in a Hugging Face cache snapshot (``.../snapshots/REV``),
    into its repository's ``blobs``. A link elsewhere (to a key) would be copied into the
    export as if it were the tokenizer's."""
    if not file.is_symlink():
        return
    home = folder.resolve()
    roots = [home]
    if home.parent.name == "snapshots":
        roots.append(home.parent.parent / "blobs")
    target = file.resolve()
    if not any(target.is_relative_to(root) for root in roots):
        raise ValueError(
            f"the run's --tokenizer {folder}: {file.name} is a link to {target}, outside the "
            "tokenizer's folder; gpipe export copies only the tokenizer's own files"
        )


def _save_quietly(model: PreTrainedModel, folder: Path) -> None:
    """``save_pretrained`` without its progress bar."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(str(folder))
    finally:
        if shown:
            logging.enable_progress_bar()


def _recorded_use_cache(config: Path) -> bool:
    """The config's own ``use_cache`` (training turns it off; generation wants it back)."""
    return bool(json.loads(config.read_text()).get("use_cache", True))


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--hf {out} is a file; give a folder to write")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--hf {out} exists and is not empty; pass --force to replace it")
    if not out.parent.is_dir():
        raise ValueError(f"--hf {out}: its parent folder {out.parent} does not exist")


def _replace(partial: Path, out: Path) -> None:
    """Rename ``partial`` to ``out``, replacing what is there whole."""
    if out.exists():
        stale = out.with_name(f".{out.name}.stale")
        shutil.rmtree(stale, ignore_errors=True)
        out.rename(stale)
        partial.rename(out)
        shutil.rmtree(stale)
    else:
        partial.rename(out)
