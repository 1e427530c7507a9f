"""Placement across devices: SPMD sharding annotations and gloo/NCCL data parallel."""
