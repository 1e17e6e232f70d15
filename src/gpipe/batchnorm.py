"""torchgpipe's ``batchnorm`` module, by its name: ``from gpipe.batchnorm import
DeferredBatchNorm``.

Deferred BatchNorm lives in ``gpipe.runtime.batchnorm``; this module gives torchgpipe's
scripts the name they import.
"""

from gpipe.runtime.batchnorm import (
    DeferredBatchNorm,
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    discard_deferred_batch_norm,
)

__all__ = [
    "DeferredBatchNorm",
    "commit_deferred_batch_norm",
    "convert_deferred_batch_norm",
    "discard_deferred_batch_norm",
]
