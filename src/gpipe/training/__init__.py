"""The job behind ``gpipe train``: the loop every rank runs, its data, checkpoints on disk,
restarts, launching local processes and the reference models."""
