"""The technique choices of a run, in one typed value: parsed once at the edge, checked once.

``Choices`` is what ``TrainConfig(choices=)``, ``plan(choices=)``, ``estimate(setup=)`` and the Hugging Face helper
take, and what the CLI builds from its flags (a config file the same). A field left ``None`` is the plan's to
choose; a value is fixed, and the plan fits the rest around it. Every rule about which choices go together is
checked here, in ``Choices.__post_init__`` (choices that contradict each other) and ``Choices.check_run`` (choices a
run with several processes cannot take), so that a bad combination fails once, at start-up, naming every problem;
each rule between two techniques is written once, in its technique's module (``memtrain.techniques``).

Example:
    >>> Choices(checkpointing="every:2", optimizer=OptimizerChoice(state_precision="bf16")).to_dict()
    {'checkpointing': 'every:2', 'offload_activations': None, 'optimizer': {'placement': None, \
'state_precision': 'bf16', 'step_in_backward': None, 'offload_fraction': None, 'name': None, 'kwargs': None}, \
'chunked_loss': None, 'compile': False, \
'pure_bf16': False, \
'offload_weights': None, 'tiled_mlp': None}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memtrain.checkpointing import Checkpointing
from memtrain.errors import ConfigError
from memtrain.message import arg
from memtrain.setting import known_fields, switch_problems
from memtrain.techniques import (
    SetUp,
    Terms,
    activation_offload,
    chunked_loss,
    problems,
    pure_bf16,
    tiled_mlp,
    weight_offload,
)
from memtrain.techniques.checkpointing import policy_of
from memtrain.techniques.optimizer import (
    CHOICE_TERMS,
    OptimizerChoice,
)

EXAMPLES_PER_RANK = 16  # the global batch per rank when neither the global batch nor the micro-batch is given


def default_global_batch(world_size: int, micro_batch_size: int | None = None) -> int:
    """Examples per optimizer step over all ranks when none is given: the micro-batch (or 16) on each rank."""
    return (micro_batch_size or EXAMPLES_PER_RANK) * world_size


@dataclass(frozen=True, kw_only=True)
class Choices:
    """The memory techniques of a run; None leaves a choice to the plan, a value fixes it.

    Args:
        checkpointing: a ``Checkpointing`` or a spelling it parses ("none", "all", "every:K", "selective",
            "blocks(RKO...)", "...+offload"); None or "auto": the plan's per-block keep / recompute / offload.
            Recomputing a block costs about one extra forward of it and keeps only its input.
        offload_activations: saved activations in pinned host memory (CUDA only; PCIe traffic instead of
            device bytes).
        optimizer: AdamW's placement and state (``OptimizerChoice``; a mapping of its fields is taken too).
        chunked_loss: the loss's fp32 logits 1024 tokens at a time, never the whole batch's.
        compile: ``torch.compile`` the step (fused kernels; the first steps compile).
        pure_bf16: bf16 weights with no fp32 master, each update rounded stochastically (``PureBF16AdamW``): 2 bytes
            per parameter of weights and 2 of gradient, no master on the device or the host. It changes the
            numerics, so the plan never picks it: only this choice turns it on (bf16-mixed precision; moments fp32
            or bf16).
        offload_weights: parameter offload: the blocks' weights live in host memory (the offloaded optimizer's
            master or its bf16 cast) and reach the device one block ahead of use, in forward and again in backward;
            the device holds the other parameters and two blocks' weights (True reduces memory: the weights that do
            not fit the device). Needs the offloaded optimizer; one process, eager.
        tiled_mlp: each block's MLP over tiles of tokens (the hidden size's count), never its whole intermediate:
            one more forward of the MLP for the long-sequence transient it removes (True reduces memory). Eager.

    Raises:
        ConfigError: every bad value and contradiction at once, each naming the fix.
    """

    checkpointing: Checkpointing | None = None  # --checkpointing: its parser and default are each command's
    offload_activations: bool | None = activation_offload.FIELD
    optimizer: OptimizerChoice = field(default_factory=OptimizerChoice)  # its own fields declare their flags
    chunked_loss: bool | None = chunked_loss.FIELD
    compile: bool = False  # --compile: train compiles the step, plan also considers compiled set-ups
    pure_bf16: bool = pure_bf16.FIELD  # True: no fp32 master (6 bytes/param less offloaded, 2 on the device)
    offload_weights: bool | None = weight_offload.FIELD
    tiled_mlp: bool | None = tiled_mlp.FIELD

    def __post_init__(self) -> None:
        policy, problems_ = policy_of(self.checkpointing)
        object.__setattr__(self, "checkpointing", policy)
        optimizer = self.optimizer
        if isinstance(optimizer, Mapping):
            optimizer = OptimizerChoice.from_dict(optimizer)
        if not isinstance(optimizer, OptimizerChoice):
            problems_.append(f"optimizer={optimizer!r} is not an OptimizerChoice. To resolve this error, pass e.g. "
                             "optimizer=OptimizerChoice(placement='offload').")
            optimizer = OptimizerChoice()
        object.__setattr__(self, "optimizer", optimizer)
        # Each technique's switch declares itself (its field's type): True / False / None (the plan's), or True /
        # False; the rules then read the values that are good, so that every problem is named at once.
        problems_ += switch_problems(self, SWITCHES)
        for name in ON_OFF:
            if not isinstance(getattr(self, name), bool):
                # Not kept as an argument: the command line names a switch by its flag, which has no such value.
                problems_.append(f"{name}={getattr(self, name)!r} must be True or False. To resolve this error, "
                                 "pass one of them.")
        good = {name: getattr(self, name) if isinstance(getattr(self, name), bool) else None
                for name in (*SWITCHES, *ON_OFF)}
        ConfigError.raise_if(problems_ + problems(self.setup(**good), CHOICE_TERMS))

    def setup(self, **run: Any) -> SetUp:
        """These choices as the rules read them, with what the run adds (``processes``, ``fsdp``, ``precision``)
        and the model's facts where a site knows them (``chunkable``, ``has_blocks``)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "optimizer"}
        return self.optimizer.setup().with_(**{**own, **run})

    def check_run(self, *, world_size: int = 1, fsdp: bool = False) -> None:
        """Raises one ConfigError for the choices a run of ``world_size`` processes cannot take."""
        ConfigError.raise_if(problems(self.setup(processes=world_size, fsdp=fsdp), CHOICE_TERMS))

    def precision_problems(self, precision: str, *, auto: bool = True) -> list[str]:
        """What these choices cannot take of a run's ``precision`` (e.g. pure bf16 computes in bf16, with no fp16
        scaler). ``auto``: the caller takes precision='auto' (a run does; an estimate of one set-up does not)."""
        either = " (or 'auto')" if auto else ""
        terms = Terms(CHOICE_TERMS.labels, {"pure-bf16-precision": f"pass {arg('precision', 'bf16-mixed')}{either}, "
                                                                   f"or drop {arg('pure_bf16')}"})
        return problems(self.setup(precision=precision), terms)

    def to_dict(self) -> dict[str, Any]:
        """JSON values (the policy as its spelling, the optimizer's as its own ``to_dict``) that ``from_dict`` reads
        back."""
        return {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Choices:
        """The choices a config file or ``to_dict`` names.

        Raises:
            ConfigError: an unknown field (naming the known ones), or any bad value.
        """
        return cls(**known_fields(cls, values, "choices"))


def _json_value(value: Any) -> Any:
    """A setting's value as JSON: a policy as its spelling, a setting type as its ``to_dict``."""
    if isinstance(value, Checkpointing):
        return str(value)
    return value.to_dict() if hasattr(value, "to_dict") else value


# The techniques' switches, by their fields' types: True / False / None (the plan's), and True / False.
SWITCHES = tuple(f.name for f in dataclasses.fields(Choices) if f.type == "bool | None")
ON_OFF = tuple(f.name for f in dataclasses.fields(Choices) if f.type == "bool")
