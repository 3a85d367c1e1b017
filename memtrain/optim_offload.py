"""Temporary: removed at merge."""

from memtrain.optim.offload import CPUOffloadOptimizer

__all__ = ["CPUOffloadOptimizer"]
