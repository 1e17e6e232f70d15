"""One stage's work: stages, the executor of a schedule, re-materialization, weight
gradients, micro-batches, deferred BatchNorm, the caches a stage generates with, and the
timeline of what ran.

``sub_sequence_attention`` is called through its module of the same name
(``gpipe.runtime.sub_sequence_attention.sub_sequence_attention``): exported, it would hide
that module."""

from gpipe.runtime.batchnorm import (
    DeferredBatchNorm,
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    discard_deferred_batch_norm,
)
from gpipe.runtime.kv_cache import CacheContext, CachedLayer, KVCache, KVLayer, LayerCache
from gpipe.runtime.partitions import even_balance, materialize
from gpipe.runtime.precision import Precision
from gpipe.runtime.recompute import CHECKPOINT_MODES, Layers, is_checkpointing, is_recomputing
from gpipe.runtime.stage import Stage
from gpipe.runtime.timeline import Event, Recorder, plot_gantt, to_chrome

__all__ = [
    "CHECKPOINT_MODES",
    "CacheContext",
    "CachedLayer",
    "DeferredBatchNorm",
    "Event",
    "KVCache",
    "KVLayer",
    "LayerCache",
    "Layers",
    "Precision",
    "Recorder",
    "Stage",
    "commit_deferred_batch_norm",
    "convert_deferred_batch_norm",
    "discard_deferred_batch_norm",
    "even_balance",
    "is_checkpointing",
    "is_recomputing",
    "materialize",
    "plot_gantt",
    "to_chrome",
]
