"""The optimizer: which class steps, where its state lives (the device, host RAM, or a share of each), and whether
each parameter steps in backward; its setting ``OptimizerChoice``, the class it names (``NamedOptimizer``) and its
rules with the other techniques. One module a concept: ``named`` (the class by name), ``technique`` (its rules, and
its part in the plan, the estimate and the Trainer helper, as every technique's module holds them) and ``choice`` (its
setting, checked by those rules); the names other modules use are taken from here.

The class is named, never chosen by the plan (it changes the numerics): memtrain's own AdamW (``"adamw"``: fused
fp32 moments, or bf16 / int8 moments, or pure bf16, through ``build_optimizer``) is one entry of the registry; any
other class is named by a short name (``named.ALIASES``), by a dotted path (``"torch.optim.Adafactor"``,
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
    SETTING_FIELDS,
    STATE_PRECISIONS,
    OptimizerChoice,
    StatePrecision,
)
from memtrain.techniques.optimizer.named import NamedOptimizer
from memtrain.techniques.optimizer.technique import GRADIENTS_BEFORE_DDP, NAMED_OWN_STATE, TECHNIQUE

__all__ = ["CHOICE_TERMS", "GRADIENTS_BEFORE_DDP", "NAMED_OWN_STATE", "SETTING_FIELDS", "STATE_PRECISIONS", "TECHNIQUE",
           "NamedOptimizer", "OptimizerChoice", "StatePrecision"]
