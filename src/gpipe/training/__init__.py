"""The job behind ``gpipe train``: the loop every rank runs, its data, checkpoints on disk,
restarts and launching local processes."""
