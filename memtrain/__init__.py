"""memtrain: make a PyTorch model fit a memory budget at the least possible slowdown."""

from memtrain.accumulation import GradientAccumulator, StepResult, accumulation_steps
from memtrain.checkpointing import (
    SelectivePolicy,
    apply_checkpointing,
    checkpoint_sequential,
    remove_checkpointing,
)
from memtrain.config import TrainConfig, TrainResult
from memtrain.data import DevicePrefetcher, make_loader
from memtrain.errors import ConfigError, MemtrainError
from memtrain.estimate import estimate
from memtrain.measure import MemoryMeter, measure
from memtrain.offload import offload_activations
from memtrain.optim import CPUOffloadOptimizer
from memtrain.planner import Plan, apply_plan, plan
from memtrain.precision import MixedPrecision, resolve_precision
from memtrain.report import MemoryReport, format_bytes, parse_bytes
from memtrain.train import train

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadOptimizer",
    "ConfigError",
    "DevicePrefetcher",
    "GradientAccumulator",
    "MemoryMeter",
    "MemoryReport",
    "MemtrainError",
    "MixedPrecision",
    "Plan",
    "SelectivePolicy",
    "StepResult",
    "TrainConfig",
    "TrainResult",
    "accumulation_steps",
    "apply_checkpointing",
    "apply_plan",
    "checkpoint_sequential",
    "estimate",
    "format_bytes",
    "make_loader",
    "measure",
    "offload_activations",
    "parse_bytes",
    "plan",
    "remove_checkpointing",
    "resolve_precision",
    "train",
]
