"""The job behind ``gpipe train``: the loop every rank runs, data, checkpoints on disk, restarts, launching, reference models."""
