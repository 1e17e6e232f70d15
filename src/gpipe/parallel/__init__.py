"""Dimensions beside the pipeline: replicas of a stage (data parallelism), their sharding, and
parameters tied across stages."""
