"""Dimensions beside the pipeline: replicas of a stage (data parallelism) and parameters
tied across stages."""
