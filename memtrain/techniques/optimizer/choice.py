"""The optimizer's setting, ``OptimizerChoice`` (``Choices.optimizer``): the class, its placement, AdamW's moments,
the step in backward and the offloaded share, each field with its flag; ``SETTING_FIELDS`` its fields and
``CHOICE_TERMS`` how messages name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from memtrain.errors import ConfigError
from memtrain.message import Message, arg, marked
from memtrain.setting import flag, is_fraction, known_fields, switch_problems
from memtrain.techniques.optimizer.named import ADAMW, ALIASES, NamedOptimizer
from memtrain.techniques.optimizer.technique import STATE_PRECISIONS, OptimizerTechnique, StatePrecision
from memtrain.techniques.rule import SetUp, Terms, problems_of

Placement = Literal["device", "offload", "offload-bf16-weights"]
PLACEMENTS: tuple[Placement, ...] = ("device", "offload", "offload-bf16-weights")

SETTING_FIELDS = ("placement", "state_precision", "step_in_backward", "offload_fraction", "name", "kwargs")
# How ``Choices`` (and ``OptimizerChoice``) name these fields in messages.
CHOICE_TERMS = Terms(labels={"placement": "optimizer.placement", "state_precision": "optimizer.state_precision",
                             "step_in_backward": "optimizer.step_in_backward",
                             "offload_fraction": "optimizer.offload_fraction", "optimizer": "optimizer.name"},
                     values={"optimizer": lambda named: repr(named.spelling)})  # as given: 'lion', not its path


def _as_name_field(problem: Message, name: Any) -> Message:
    """A ``NamedOptimizer`` problem that names the value ``optimizer=``, naming this setting's field instead
    (``optimizer.name=``, kept as an argument where the value is ``name`` as given)."""
    given = f"optimizer={name!r}"
    if problem.startswith(given):
        return Message(arg("optimizer.name", name) + marked(problem).removeprefix(given))
    if problem.startswith("optimizer="):  # a value NamedOptimizer.of spells its own way (a NamedOptimizer's class)
        return Message(f"optimizer.name={marked(problem).removeprefix('optimizer=')}")
    return problem


# -- the setting -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OptimizerChoice:
    """The optimizer, its placement and state; None leaves a field to the plan (the optimizer itself never is).

    placement: "device" (state on the device; with ``offload_fraction`` a share of it in host RAM), "offload"
        (``CPUOffloadOptimizer``: fp32 master weights and AdamW state in host RAM, 12 fewer device bytes a
        parameter, gradients streamed there during backward) or "offload-bf16-weights" (the same, with the device's
        weights bf16 casts of the host master: 2 more bytes a parameter off the device; bf16-mixed only;
        ``--offload-optimizer bf16-weights``).
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
        "host RAM, 8-12 bytes per parameter off the device; --offload-optimizer bf16-weights: the device's weights "
        "bf16 casts of that master, 2 bytes per parameter less again (bf16-mixed only) ({unset})", kind="switch",
        values=("offload", "device"), more=(("offload-bf16-weights", "bf16-weights"),)))
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
        return cls(**known_fields(cls, values, "optimizer"))

    def problems(self) -> list[str]:
        """Every bad value and contradiction among the optimizer's choices, in words naming the fix."""
        problems = []
        if self.placement not in (None, *PLACEMENTS):
            # Not kept as an argument: the command line names a placement by its flag, which has no such value.
            problems.append(f"optimizer.placement={self.placement!r} is not one of 'device', 'offload', "
                            "'offload-bf16-weights', or None (the plan decides). To resolve this error, pass one of "
                            "them.")
        if self.state_precision not in (None, *STATE_PRECISIONS):
            problems.append(Message(f"{arg('optimizer.state_precision', self.state_precision)} is not one of 'fp32', "
                                    "'bf16', 'int8', or None (the plan decides). To resolve this error, pass one of "
                                    "them."))
        problems += switch_problems(self, ("step_in_backward",), "optimizer.")
        if self.offload_fraction is not None and not is_fraction(self.offload_fraction):
            problems.append(Message(f"{arg('optimizer.offload_fraction', self.offload_fraction)} must be a fraction "
                                    "in [0, 1], or None (the plan decides). To resolve this error, pass e.g. "
                                    f"{arg('offload_fraction', 0.5)}."))
        if self.kwargs is not None and not isinstance(self.kwargs, (Mapping, tuple)):
            problems.append(Message(f"{arg('optimizer.kwargs', self.kwargs)} is not a mapping of argument names to "
                                    "values. To resolve this error, pass e.g. kwargs={'beta2_decay': -0.8}."))
        if problems:
            return problems
        if self.kwargs and (self.name is None or isinstance(self.name, str) and self.name.strip().lower() == ADAMW):
            return [Message(f"{arg('optimizer.kwargs', dict(self.kwargs))} with memtrain's AdamW: it takes no keyword "
                            f"arguments of its own (its settings are {arg('optimizer.state_precision')}, "
                            f"{arg('pure_bf16')}, {arg('adam_betas')} and {arg('adam_eps')}). To resolve this error, "
                            f"drop {arg('optimizer.kwargs')}, or pass {arg('optimizer.name')} (the class they are for, "
                            "e.g. 'torch.optim.AdamW').")]
        try:
            named = self.named
        except ConfigError as e:  # NamedOptimizer names its argument optimizer=: here it is this field
            return [_as_name_field(p, self.name) for p in e.problems]
        return problems_of(self.setup(named), CHOICE_TERMS, OptimizerTechnique.rules)

    def setup(self, named: NamedOptimizer | None = None) -> SetUp:
        """These choices as the rules read them."""
        return SetUp(placement=self.placement, state_precision=self.state_precision,
                     step_in_backward=self.step_in_backward, offload_fraction=self.offload_fraction,
                     optimizer=named or self.named)

    @property
    def fixed_placement(self) -> Placement | None:
        """The placement these choices imply: an in-backward step and a partial offload are device optimizers, so
        either fixes "device" where the placement itself is left open (lean moments go with either placement)."""
        if self.placement is not None:
            return self.placement
        if self.step_in_backward or self.offload_fraction is not None:
            return "device"
        return None
