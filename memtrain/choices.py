"""The technique choices of a run, in one typed value: parsed once at the edge, checked once.

``Choices`` is what ``TrainConfig(choices=)``, ``plan(choices=)``, ``estimate(setup=)`` and the Hugging Face helper
take, and what the CLI builds from its flags (a config file the same). A field left ``None`` is the plan's to
choose; a value is fixed, and the plan fits the rest around it. Every rule about which choices go together is
checked here, in ``Choices.__post_init__`` (choices that contradict each other) and ``Choices.check_run`` (choices a
run with several processes cannot take), so that a bad combination fails once, at start-up, naming every problem;
each rule between two techniques is written once, in ``memtrain.rules``.

Example:
    >>> Choices(checkpointing="every:2", optimizer=OptimizerChoice(state_precision="bf16")).to_dict()
    {'checkpointing': 'every:2', 'offload_activations': None, 'optimizer': {'placement': None, \
'state_precision': 'bf16', 'step_in_backward': None, 'offload_fraction': None, 'name': None, 'kwargs': None}, \
'chunked_loss': None, 'compile': False, \
'pure_bf16': False, \
'offload_weights': None}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from memtrain import rules
from memtrain.checkpointing import Checkpointing
from memtrain.errors import ConfigError
from memtrain.optim.named import ALIASES, NamedOptimizer, own_state_problems
from memtrain.setting import flag

Placement = Literal["device", "offload"]
StatePrecision = Literal["fp32", "bf16", "int8"]
PLACEMENTS: tuple[Placement, ...] = ("device", "offload")
STATE_PRECISIONS: tuple[StatePrecision, ...] = ("fp32", "bf16", "int8")
EXAMPLES_PER_RANK = 16  # the global batch per rank when neither the global batch nor the micro-batch is given


def default_global_batch(world_size: int, micro_batch_size: int | None = None) -> int:
    """Examples per optimizer step over all ranks when none is given: the micro-batch (or 16) on each rank."""
    return (micro_batch_size or EXAMPLES_PER_RANK) * world_size


def _is_fraction(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0.0 <= value <= 1.0)


def _switch_problems(owner: Any, names: tuple[str, ...], prefix: str = "") -> list[str]:
    return [f"{prefix}{name}={getattr(owner, name)!r} must be True, False, or None (the plan decides). To resolve "
            "this error, pass one of them." for name in names
            if getattr(owner, name) is not None and not isinstance(getattr(owner, name), bool)]


@dataclass(frozen=True, kw_only=True)
class OptimizerChoice:
    """The optimizer, its placement and state; None leaves a field to the plan (the optimizer itself never is).

    placement: "device" (state on the device; with ``offload_fraction`` a share of it in host RAM) or "offload"
        (``CPUOffloadOptimizer``: fp32 master weights and AdamW state in host RAM, 12 fewer device bytes a
        parameter, gradients streamed there during backward).
    state_precision: AdamW's moments, where the state lives (the device, or host RAM with "offload"): "fp32" (8
        bytes a parameter), "bf16" (4), "int8" (about 2). The master weights stay fp32 either way.
    step_in_backward: each parameter steps as its gradient is final, which is freed at once (no gradient buffers).
    offload_fraction: this share of a device optimizer's state in host RAM, in [0, 1].
    name: the optimizer: None or "adamw" (memtrain's AdamW, with the state precisions above), or any other
        ``torch.optim.Optimizer`` by short name ("adafactor", "lion", ...), dotted path ("torch.optim.Adafactor") or
        class. It gets the run's lr, weight decay, betas and eps where it takes them (in the same form) and
        ``kwargs``; it keeps its own state (no lean moments, no pure bf16), measured by a probe step; the
        placements wrap it alike. Changing it changes the numerics, so the plan never does.
    kwargs: the named class's own hyper-parameters (e.g. ``{"beta2_decay": -0.8}``).
    """

    placement: Placement | None = field(default=None, metadata=flag(
        "--offload-optimizer", "fp32 master weights and the optimizer state (AdamW's moments as --optimizer-state) in "
        "host RAM, 8-12 bytes per parameter off the device ({unset})", kind="switch", values=("offload", "device")))
    state_precision: StatePrecision | None = field(default=None, metadata=flag(
        "--optimizer-state", "AdamW's moments, on the device or (--offload-optimizer) in host RAM: fp32 (8 bytes per "
        "parameter), bf16 (4) or int8 (about 2; needs bitsandbytes) ({unset})", choices=STATE_PRECISIONS,
        off="fp32"))
    step_in_backward: bool | None = field(default=None, metadata=flag(
        "--step-in-backward", "each parameter steps as soon as its gradient is final, which is freed at once: the "
        "whole model's gradients never coexist ({unset})", kind="switch"))
    offload_fraction: float | None = field(default=None, metadata=flag(
        "--offload-optimizer-fraction", "this share of the parameters' fp32 master and optimizer state in host RAM, "
        "the rest on the device ({unset})", parse="fraction", metavar="F"))
    name: Any = field(default=None, metadata=flag(
        "--optimizer", "the optimizer: adamw (memtrain's: --optimizer-state, --pure-bf16, the fused host step; "
        f"default), a short name ({', '.join(sorted(ALIASES))}) or any torch.optim.Optimizer class by dotted path "
        "(e.g. torch.optim.Adafactor). It gets --lr, --weight-decay, --adam-betas and --adam-eps where it takes "
        "them; its state is its own, measured by a probe step; --offload-optimizer, --offload-optimizer-fraction and "
        "--step-in-backward wrap it alike. Never chosen by the plan", metavar="NAME"))
    kwargs: Any = field(default=None, metadata=flag(
        "--optimizer-arg", "a keyword argument of the --optimizer class (repeatable; the value a Python literal, e.g. "
        "--optimizer-arg beta2_decay=-0.8; in a --config file a table: optimizer-arg = {{ beta2_decay = -0.8 }})",
        kind="pairs", metavar="KEY=VALUE"))

    def __post_init__(self) -> None:
        problems = self.problems()
        if not problems and self.kwargs is not None:  # a hashable value, as the rest of the choices
            object.__setattr__(self, "kwargs", self.named.kwargs)
        ConfigError.raise_if(problems)

    @property
    def named(self) -> NamedOptimizer:
        """The optimizer these choices name (memtrain's AdamW by default)."""
        return NamedOptimizer.of(self.name, None if self.kwargs is None else dict(self.kwargs))

    def to_dict(self) -> dict[str, Any]:
        """JSON values: the optimizer as its dotted path (None: memtrain's AdamW) and its kwargs as a mapping."""
        named = self.named
        return {"placement": self.placement, "state_precision": self.state_precision,
                "step_in_backward": self.step_in_backward, "offload_fraction": self.offload_fraction,
                "name": None if named.is_adamw else named.path, "kwargs": dict(named.kwargs) or None}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> OptimizerChoice:
        """The optimizer choices a config file or ``Choices.to_dict`` names (ConfigError: an unknown field)."""
        return cls(**_known_fields(cls, values, "optimizer"))

    def problems(self) -> list[str]:
        """Every bad value and contradiction among the optimizer's choices, in words naming the fix."""
        problems = []
        if self.placement not in (None, *PLACEMENTS):
            problems.append(f"optimizer.placement={self.placement!r} is not one of 'device', 'offload', or None (the "
                            "plan decides). To resolve this error, pass one of them.")
        if self.state_precision not in (None, *STATE_PRECISIONS):
            problems.append(f"optimizer.state_precision={self.state_precision!r} is not one of 'fp32', 'bf16', "
                            "'int8', or None (the plan decides). To resolve this error, pass one of them.")
        problems += _switch_problems(self, ("step_in_backward",), "optimizer.")
        if self.offload_fraction is not None and not _is_fraction(self.offload_fraction):
            problems.append(f"optimizer.offload_fraction={self.offload_fraction!r} must be a fraction in [0, 1], or "
                            "None (the plan decides). To resolve this error, pass e.g. offload_fraction=0.5.")
        if self.kwargs is not None and not isinstance(self.kwargs, (Mapping, tuple)):
            problems.append(f"optimizer.kwargs={self.kwargs!r} is not a mapping of argument names to values. To "
                            "resolve this error, pass e.g. kwargs={'beta2_decay': -0.8}.")
        if problems:
            return problems
        try:
            problems += own_state_problems(self.named, self.state_precision, False, "optimizer.")
        except ConfigError as e:
            return [f"optimizer.name={p.removeprefix('optimizer=')}" if p.startswith("optimizer=") else p
                    for p in e.problems]
        if self.placement == "offload":
            if self.offload_fraction is not None:
                problems.append(rules.OFFLOAD_WITH_FRACTION.message(
                    f"optimizer.placement='offload' with offload_fraction={self.offload_fraction}"))
            if self.step_in_backward:
                problems.append(rules.OFFLOAD_WITH_IN_BACKWARD.message(
                    "optimizer.placement='offload' with step_in_backward=True"))
        if rules.in_backward_with_fraction(self.step_in_backward, self.offload_fraction):
            problems.append(rules.IN_BACKWARD_WITH_FRACTION.message(
                "optimizer.step_in_backward=True with offload_fraction"))
        return problems

    @property
    def fixed_placement(self) -> Placement | None:
        """The placement these choices imply: an in-backward step and a partial offload are device optimizers, so
        either fixes "device" where the placement itself is left open (lean moments go with either placement)."""
        if self.placement is not None:
            return self.placement
        if self.step_in_backward or self.offload_fraction is not None:
            return "device"
        return None


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

    Raises:
        ConfigError: every bad value and contradiction at once, each naming the fix.
    """

    checkpointing: Checkpointing | None = None  # --checkpointing: its parser and default are each command's
    offload_activations: bool | None = field(default=None, metadata=flag(
        "--offload-activations", "saved activations in pinned host memory, prefetched before backward (CUDA; "
        "{unset})", kind="switch"))
    optimizer: OptimizerChoice = field(default_factory=OptimizerChoice)  # its own fields declare their flags
    chunked_loss: bool | None = field(default=None, metadata=flag(
        "--chunked-loss", "the loss's fp32 logits 1024 tokens at a time, never whole ({unset})", kind="switch",
        off="on with checkpointing where the model allows it"))
    compile: bool = False  # --compile: train compiles the step, plan also considers compiled set-ups
    # True: no fp32 master (6 bytes/param less with an offloaded optimizer, 2 on the device)
    pure_bf16: bool = field(default=False, metadata=flag(
        "--pure-bf16", "bf16 weights with no fp32 master, each update rounded stochastically: 2 bytes per parameter "
        "of weights and 2 of gradient, no master on the device or in host RAM; moments fp32 or bf16 "
        "(--optimizer-state). Changes the numerics: never chosen by the plan (default: off; bf16-mixed precision)",
        kind="on"))
    offload_weights: bool | None = field(default=None, metadata=flag(
        "--offload-weights", "parameter offload: the blocks' weights in host RAM (the offloaded optimizer's master), "
        "each on the device only while in use, one block ahead; for weights that do not fit the device. Needs "
        "--offload-optimizer, one process, no --compile ({unset})", kind="switch"))

    def __post_init__(self) -> None:
        problems: list[str] = []
        policy = self.checkpointing
        if isinstance(policy, str) and policy.strip().lower() == "auto":
            policy = None
        if policy is not None and not isinstance(policy, Checkpointing):
            if isinstance(policy, (bool, int)):  # parse would read 3 as every:3, True as all: a choice names its policy
                policy = None
                problems.append(f"checkpointing={self.checkpointing!r} is not a policy. To resolve this error, pass "
                                "'auto', 'none', 'all', 'every:K' (e.g. 'every:2'), 'selective', or a Checkpointing.")
            else:
                try:
                    policy = Checkpointing.parse(policy)
                except ConfigError as e:
                    policy = None
                    problems += [p if p.startswith("checkpointing") else f"checkpointing={self.checkpointing!r}: {p}"
                                 for p in e.problems]
        object.__setattr__(self, "checkpointing", policy)
        optimizer = self.optimizer
        if isinstance(optimizer, Mapping):
            optimizer = OptimizerChoice.from_dict(optimizer)
        if not isinstance(optimizer, OptimizerChoice):
            problems.append(f"optimizer={optimizer!r} is not an OptimizerChoice. To resolve this error, pass e.g. "
                            "optimizer=OptimizerChoice(placement='offload').")
            optimizer = OptimizerChoice()
        object.__setattr__(self, "optimizer", optimizer)
        problems += _switch_problems(self, ("offload_activations", "chunked_loss"))
        problems += _switch_problems(self, ("offload_weights",))
        problems += self._offload_weights_problems(optimizer)
        if not isinstance(self.compile, bool):
            problems.append(f"compile={self.compile!r} must be True or False. To resolve this error, pass one of them.")
        if not isinstance(self.pure_bf16, bool):
            problems.append(f"pure_bf16={self.pure_bf16!r} must be True or False. To resolve this error, pass one of "
                            "them.")
        elif self.pure_bf16 and not optimizer.named.is_adamw:
            problems += own_state_problems(optimizer.named, None, True)
        elif rules.pure_bf16_int8(self.pure_bf16, optimizer.state_precision):
            problems.append(rules.PURE_BF16_INT8.message("pure_bf16=True with optimizer.state_precision='int8'"))
        if policy is not None and policy.offload_inputs and self.offload_activations is False:
            problems.append(rules.CHECKPOINT_OFFLOAD_INPUTS.message(f"checkpointing={str(policy)!r}"))
        ConfigError.raise_if(problems)

    def _offload_weights_problems(self, optimizer: OptimizerChoice) -> list[str]:
        """Parameter offload's contradictions: its host weights are the offloaded optimizer's, and its hooks run
        eagerly."""
        if self.offload_weights is not True:
            return []
        problems = []
        if optimizer.fixed_placement == "device":
            given = [f"optimizer.{name}={getattr(optimizer, name)!r}" for name in
                     ("placement", "step_in_backward", "offload_fraction") if getattr(optimizer, name) is not None]
            problems.append(rules.OFFLOAD_WEIGHTS_DEVICE_OPTIMIZER.message(
                f"offload_weights=True with {' and '.join(given)} (AdamW on the device, however much of its state a "
                "partial offload puts in host RAM)", fix=f"drop {' and '.join(given)}, or drop offload_weights=True"))
        if self.compile is True:
            problems.append(rules.OFFLOAD_WEIGHTS_COMPILE.message("offload_weights=True with compile=True"))
        if self.pure_bf16 is True:
            problems.append(rules.OFFLOAD_WEIGHTS_PURE_BF16.message("offload_weights=True with pure_bf16=True"))
        return problems

    def check_run(self, *, world_size: int = 1, fsdp: bool = False) -> None:
        """Raises one ConfigError for the choices a run of ``world_size`` processes cannot take."""
        problems = []
        if self.offload_weights and (fsdp or world_size > 1):
            problems.append(rules.OFFLOAD_WEIGHTS_ONE_PROCESS.message(
                f"offload_weights=True with {'fsdp=True' if fsdp else f'{world_size} processes'}"))
        if rules.offload_optimizer_fsdp(self.optimizer.placement == "offload", fsdp):
            problems.append(rules.OFFLOAD_OPTIMIZER_FSDP.message(
                "optimizer.placement='offload' and fsdp=True together",
                fix="drop one of optimizer.placement='offload' and fsdp=True"))
        if self.pure_bf16 is True and fsdp:
            problems.append(rules.PURE_BF16_FSDP.message("pure_bf16=True and fsdp=True together"))
        if rules.gradients_before_ddp(self.optimizer.step_in_backward, self.optimizer.offload_fraction,
                                      world_size > 1):
            given = [f"optimizer.{name}={getattr(self.optimizer, name)!r}"
                     for name in ("step_in_backward", "offload_fraction") if getattr(self.optimizer, name)]
            problems.append(rules.GRADIENTS_BEFORE_DDP.message(
                f"{' and '.join(given)}, and this run has {world_size} processes",
                fix=f"drop {'them' if len(given) > 1 else 'it'}, or run one process"))
        ConfigError.raise_if(problems)

    def precision_problems(self, precision: str, *, auto: bool = True) -> list[str]:
        """What these choices cannot take of a run's ``precision``: pure bf16 computes in bf16 (no fp16 scaler).
        ``auto``: the caller takes precision='auto' (a run does; an estimate of one set-up does not)."""
        if self.pure_bf16 is True and rules.pure_bf16_precision(self.pure_bf16, precision):
            either = " (or 'auto')" if auto else ""
            return [rules.PURE_BF16_PRECISION.message(f"pure_bf16=True with precision={precision!r}",
                                                      fix=f"pass precision='bf16-mixed'{either}, or drop pure_bf16")]
        return []

    @property
    def offloads_activations(self) -> bool | None:
        """Whether activations go to the host: True where asked for directly or by a "+offload" policy."""
        if self.checkpointing is not None and self.checkpointing.offload_inputs:
            return True
        return self.offload_activations

    def to_dict(self) -> dict[str, Any]:
        """JSON values (the policy as its spelling) that ``from_dict`` reads back."""
        return {"checkpointing": None if self.checkpointing is None else str(self.checkpointing),
                "offload_activations": self.offload_activations, "optimizer": self.optimizer.to_dict(),
                "chunked_loss": self.chunked_loss, "compile": self.compile, "pure_bf16": self.pure_bf16,
                "offload_weights": self.offload_weights}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Choices:
        """The choices a config file or ``to_dict`` names.

        Raises:
            ConfigError: an unknown field (naming the known ones), or any bad value.
        """
        return cls(**_known_fields(cls, values, "choices"))


def _known_fields(cls: type, values: Mapping[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{what}={values!r} is not a mapping of field names to values. To resolve this error, pass "
                          f"e.g. {{'{dataclasses.fields(cls)[0].name}': ...}}.")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"{what}: unknown {'field' if len(unknown) == 1 else 'fields'} {', '.join(unknown)}. To "
                          f"resolve this error, use {', '.join(names)}.")
    return dict(values)
