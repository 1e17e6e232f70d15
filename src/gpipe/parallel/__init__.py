"""Dimensions beside the pipeline: replicas of a stage (data parallelism), their sharding, its
layers split over tensor ranks (tensor parallelism), and parameters tied across stages."""
