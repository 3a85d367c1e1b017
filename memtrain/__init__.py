"""memtrain: make a PyTorch model fit a memory budget at the least possible slowdown."""

from memtrain.checkpointing import (
    SelectivePolicy,
    apply_checkpointing,
    checkpoint_sequential,
    remove_checkpointing,
)
from memtrain.errors import ConfigError, MemtrainError
from memtrain.measure import MemoryMeter, measure
from memtrain.report import MemoryReport, format_bytes, parse_bytes
from memtrain.train import TrainConfig, TrainResult, train

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "MemoryMeter",
    "MemoryReport",
    "MemtrainError",
    "SelectivePolicy",
    "TrainConfig",
    "TrainResult",
    "apply_checkpointing",
    "checkpoint_sequential",
    "format_bytes",
    "measure",
    "parse_bytes",
    "remove_checkpointing",
    "train",
]
