"""memtrain: make a PyTorch model fit a memory budget at the least possible slowdown.

The public surface is the contract's names and the few types they take (docs/design.md, "Public surface");
everything else is imported from its part (``memtrain.data``, ``memtrain.loss``, ``memtrain.run`` ...).
README.md's "Layout" says what each part holds.
"""

from memtrain.accumulation import GradientAccumulator
from memtrain.checkpointing import Checkpointing, apply_checkpointing, remove_checkpointing
from memtrain.choices import Choices
from memtrain.config import TrainConfig, TrainResult
from memtrain.device import active_simulation as _start_a_simulation_the_environment_asks_for
from memtrain.errors import ConfigError, MemtrainError
from memtrain.estimate import estimate
from memtrain.measure import MemoryMeter, measure
from memtrain.offload import offload_activations
from memtrain.optim import CPUOffloadOptimizer
from memtrain.planner import Plan, PlanSettings, apply_plan, plan
from memtrain.precision import MixedPrecision, resolve_precision
from memtrain.report import MemoryReport
from memtrain.train import train

__version__ = "0.1.0"

# MEMTRAIN_SIMULATED_DEVICE: the simulated device starts on the importing (main) thread, whose ops its ledger sees.
_start_a_simulation_the_environment_asks_for()

__all__ = [
    "CPUOffloadOptimizer",
    "Checkpointing",
    "Choices",
    "ConfigError",
    "GradientAccumulator",
    "MemoryMeter",
    "MemoryReport",
    "MemtrainError",
    "MixedPrecision",
    "Plan",
    "PlanSettings",
    "TrainConfig",
    "TrainResult",
    "apply_checkpointing",
    "apply_plan",
    "estimate",
    "measure",
    "offload_activations",
    "plan",
    "remove_checkpointing",
    "resolve_precision",
    "train",
]
