"""A run's checkpoints on disk: the format (torch.distributed.checkpoint folders renamed
into place, with a manifest of digests), the writer that saves in the background (a thread or
a helper process per rank), retention, and the choice of checkpoint a run continues from.

``safe_reading``, the reader that opens a checkpoint without running code from it, and
``pieces``, the planners that write and read a shard made of several blocks of its tensor, are
imported by their own names: they import torch.distributed.checkpoint, which takes most of a
second that a process touching no checkpoint need not spend."""

from gpipe.training.checkpoints.format import (
    DESCRIPTION,
    DamagedCheckpointWarning,
    begin_save,
    checkpoint_dirs,
    checkpoint_group,
    discard_partial,
    finish_save,
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    read_description,
    read_run_record,
    save_checkpoint,
    saved_state,
    verify_checkpoint,
)
from gpipe.training.checkpoints.manifest import (
    MANIFEST,
    Digest,
    digest,
    listed_files,
    verify,
    write_manifest,
)
from gpipe.training.checkpoints.resuming import (
    NothingToResume,
    resume_point,
    trim_metrics,
)
from gpipe.training.checkpoints.retention import (
    Retention,
    prune_checkpoints,
)
from gpipe.training.checkpoints.save_process import (
    SaveProcess,
    shared_memory_room,
    state_bytes,
)
from gpipe.training.checkpoints.writer import (
    PROCESS_BYTES,
    CheckpointWriter,
)

__all__ = [
    "CheckpointWriter",
    "DESCRIPTION",
    "DamagedCheckpointWarning",
    "Digest",
    "MANIFEST",
    "NothingToResume",
    "PROCESS_BYTES",
    "Retention",
    "SaveProcess",
    "begin_save",
    "checkpoint_dirs",
    "checkpoint_group",
    "digest",
    "discard_partial",
    "finish_save",
    "latest_checkpoint",
    "listed_files",
    "load_checkpoint",
    "load_model_weights",
    "prune_checkpoints",
    "read_description",
    "read_run_record",
    "resume_point",
    "save_checkpoint",
    "saved_state",
    "shared_memory_room",
    "state_bytes",
    "trim_metrics",
    "verify",
    "verify_checkpoint",
    "write_manifest",
]
