"""One stage's work: stages, the executor of a schedule, re-materialization, weight
gradients, micro-batches, deferred BatchNorm, the caches a stage generates with, and the
timeline of what ran."""

from gpipe.runtime.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from gpipe.runtime.executor import StepData, run_program
from gpipe.runtime.kv_cache import CacheContext, CachedLayer, KVCache, KVLayer, LayerCache
from gpipe.runtime.partitions import even_balance, materialize
from gpipe.runtime.precision import Precision
from gpipe.runtime.recompute import CHECKPOINT_MODES, Layers, is_checkpointing, is_recomputing
from gpipe.runtime.seq_chunks import observe
from gpipe.runtime.stage import Stage
from gpipe.runtime.sub_sequence_attention import sub_sequence_attention
from gpipe.runtime.timeline import Event, Recorder, merge, plot_gantt, to_chrome

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
    "StepData",
    "convert_deferred_batch_norm",
    "even_balance",
    "is_checkpointing",
    "is_recomputing",
    "materialize",
    "merge",
    "observe",
    "plot_gantt",
    "run_program",
    "sub_sequence_attention",
    "to_chrome",
]
