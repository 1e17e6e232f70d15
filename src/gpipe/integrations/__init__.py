"""Pipeline parallelism inside the trainers people already use.

``gpipe.integrations.transformers``: ``PipelineTrainer`` and ``pipelined(TrainerClass)`` for
Hugging Face's ``Trainer`` and the TRL trainers built on it. ``gpipe.integrations.lightning``:
``PipelineStrategy`` for PyTorch Lightning. Each integration is its own module and imports its
framework itself, so importing this package costs nothing.
"""
