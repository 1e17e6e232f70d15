"""The job behind ``gpipe train``: a run's configuration (``TrainConfig``) and ``train``, the
loop every rank runs, its data, checkpoints on disk, restarts, launching local processes."""

from gpipe.training.config import TrainConfig
from gpipe.training.run import train

__all__ = ["TrainConfig", "train"]
