"""Dimensions beside the pipeline: replicas of a stage (data parallelism), their sharding, its
layers split over tensor ranks (tensor parallelism; a mixture of experts' stacked experts each
split over them too), and parameters tied across stages.

Two names are imported from their own modules, where a tensor plan uses them:
``gpipe.parallel.experts.ExpertsParallel`` and
``gpipe.parallel.summed_gradients.SummedGradients``. They are styles of PyTorch's tensor
parallelism, whose module (``torch.distributed.tensor``, a second to import) a run without
tensor or expert parallelism never loads.
"""

from gpipe.parallel.replicas import Replicas, bucket_size, shard
from gpipe.parallel.sharding import Sharding
from gpipe.parallel.tensor import ParallelMesh, TensorPlan
from gpipe.parallel.ties import Tie, find_ties
from gpipe.parallel.world import Dimensions, World

__all__ = [
    "Dimensions",
    "ParallelMesh",
    "Replicas",
    "Sharding",
    "TensorPlan",
    "Tie",
    "World",
    "bucket_size",
    "find_ties",
    "shard",
]
