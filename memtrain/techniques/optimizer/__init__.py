"""The optimizer: which class steps, where its state lives (the device, host RAM, or a share of each), and whether
each parameter steps in backward; its setting ``OptimizerChoice``, the class it names (``NamedOptimizer``) and its
rules with the other techniques. One module a concept: ``named`` (the class by name), ``technique`` (its rules, and
its part in the plan, the estimate and the Trainer helper, as every technique's module holds them) and ``choice`` (its
setting, checked by those rules); every name is taken from here.

The class is named, never chosen by the plan (it changes the numerics): memtrain's own AdamW (``"adamw"``: fused
fp32 moments, or bf16 / int8 moments, or pure bf16, through ``build_optimizer``) is one entry of the registry; any
other class is named by a short name (``ALIASES``), by a dotted path (``"torch.optim.Adafactor"``,
``"pytorch_optimizer.Lion"``) or, in Python, by the class itself, and its bytes are measured by probe steps
(``memtrain.optim.probe``). The placement, AdamW's moment precision, the step in backward and the offloaded share
are the plan's where left ``None``; the wrappers (host offload, step in backward, partial offload) take any class.

Example:
    >>> OptimizerChoice(placement="offload", step_in_backward=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    memtrain.errors.ConfigError: optimizer.placement='offload' with optimizer.step_in_backward=True: the offloaded ...
"""

from __future__ import annotations

from memtrain.techniques.optimizer.choice import (
    CHOICE_TERMS,
    PLACEMENTS,
    SETTING_FIELDS,
    STATE_PRECISIONS,
    OptimizerChoice,
    Placement,
    StatePrecision,
)
from memtrain.techniques.optimizer.named import ADAMW, ALIASES, EXTRAS, FrozenMapping, NamedOptimizer
from memtrain.techniques.optimizer.technique import (
    BF16_WEIGHTS_PRECISION,
    GRADIENTS_BEFORE_DDP,
    IN_BACKWARD_FP16_SCALER,
    IN_BACKWARD_PER_PARAMETER,
    IN_BACKWARD_WITH_FRACTION,
    NAMED_OWN_STATE,
    NOT_PER_PARAMETER,
    OFFLOAD_OPTIMIZER_FSDP,
    OFFLOAD_WITH_FRACTION,
    OFFLOAD_WITH_IN_BACKWARD,
    OFFLOADED,
    PLACEMENT_TEXT,
    TECHNIQUE,
    OptimizerTechnique,
)

__all__ = ["ADAMW", "ALIASES", "BF16_WEIGHTS_PRECISION", "CHOICE_TERMS", "EXTRAS", "GRADIENTS_BEFORE_DDP",
           "IN_BACKWARD_FP16_SCALER", "IN_BACKWARD_PER_PARAMETER", "IN_BACKWARD_WITH_FRACTION", "NAMED_OWN_STATE",
           "NOT_PER_PARAMETER", "OFFLOADED", "OFFLOAD_OPTIMIZER_FSDP", "OFFLOAD_WITH_FRACTION",
           "OFFLOAD_WITH_IN_BACKWARD", "PLACEMENTS", "PLACEMENT_TEXT", "SETTING_FIELDS", "STATE_PRECISIONS",
           "TECHNIQUE", "FrozenMapping", "NamedOptimizer", "OptimizerChoice", "OptimizerTechnique", "Placement",
           "StatePrecision"]
