"""The optimizer: which class steps, where its state lives (the device, host RAM, or a share of each), and whether
each parameter steps in backward; its setting ``OptimizerChoice``, the class it names (``NamedOptimizer``) and its
rules with the other techniques.

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

import functools
import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from memtrain.errors import ConfigError
from memtrain.setting import flag, is_fraction, known_fields, switch_problems
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule, SetUp, Terms, problems_of
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchSpace

ADAMW = "adamw"  # memtrain's AdamW (build_optimizer): state precision, pure bf16, the fused host kernels
# Short names the CLI and config files take for well-known classes (any dotted path works too).
ALIASES = {
    "adafactor": "torch.optim.Adafactor",
    "adam": "torch.optim.Adam",
    "sgd": "torch.optim.SGD",
    "lion": "pytorch_optimizer.Lion",
    "came": "pytorch_optimizer.CAME",
}
# The pip command that installs a package an optimizer path names.
EXTRAS = {
    "pytorch_optimizer": "pip install 'memtrain[optimizers]'",
    "bitsandbytes": "pip install 'memtrain[lowbit]'",
    "torchao": "pip install torchao",
}
# Hyper-parameters the training config gives every optimizer; the others keep the class's defaults unless named in
# the optimizer's kwargs (AdamW's betas and eps mean something else, or nothing, to other classes).
_SHARED = ("lr", "weight_decay")


@dataclass(frozen=True)
class NamedOptimizer:
    """An optimizer class by name, with the keyword arguments it is built with beyond lr and weight decay.

    Attributes:
        path: ``"adamw"`` (memtrain's AdamW) or the class's dotted path.
        kwargs: the class's own hyper-parameters, e.g. ``(("beta2_decay", -0.8),)``; a mapping is taken by ``of``.
    """

    path: str = ADAMW
    kwargs: tuple[tuple[str, Any], ...] = ()
    cls: type | None = field(default=None, compare=False, repr=False)  # a class given as an object (Python API)

    @classmethod
    def of(cls, value: Any = None, kwargs: Mapping[str, Any] | None = None) -> NamedOptimizer:
        """``value``: None or "adamw" (memtrain's AdamW), a short name (``ALIASES``), a dotted path, an optimizer
        class, or a ``NamedOptimizer``; ``kwargs``: the class's own hyper-parameters.

        Raises:
            ConfigError: a value that names no optimizer (it is resolved, so a missing package is named now).
        """
        if isinstance(value, NamedOptimizer):
            if kwargs is None:
                return value
            value = value.cls or (None if value.is_adamw else value.path)
        args = _frozen(kwargs or {})
        if isinstance(value, str) and value.strip().lower() == ADAMW:
            value = None
        if value is None or value is torch.optim.AdamW and not args:
            if args:
                raise ConfigError(f"optimizer kwargs {dict(args)} with memtrain's AdamW: its settings are "
                                  "state_precision, pure_bf16 and the training config's betas and eps. To resolve "
                                  "this error, drop the kwargs, or name a class (e.g. 'torch.optim.AdamW').")
            return NamedOptimizer()
        if isinstance(value, type):
            named = NamedOptimizer(_public_path(value), args, value)
        elif isinstance(value, str) and value.strip():
            named = NamedOptimizer(ALIASES.get(value.strip().lower(), value.strip()), args)
        else:
            raise ConfigError(f"optimizer={value!r} names no optimizer. To resolve this error, pass 'adamw', a short "
                              f"name ({', '.join(sorted(ALIASES))}), a dotted path such as 'torch.optim.Adafactor', "
                              "or a torch.optim.Optimizer class.")
        try:
            named.resolve()
        except ConfigError as e:
            raise ConfigError(f"optimizer={value!r}: {e.problems[0]}") from None
        return named

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | str | None) -> NamedOptimizer:
        """What ``to_dict`` wrote (a bare path is taken too)."""
        if d is None or isinstance(d, str):
            return cls.of(d)
        return cls.of(d.get("path"), d.get("kwargs") or {})

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kwargs": dict(self.kwargs)}

    def __str__(self) -> str:
        return self.path

    @property
    def is_adamw(self) -> bool:
        """memtrain's own AdamW (lean moments, pure bf16, the fused host kernels), not a named class."""
        return self.path == ADAMW

    @property
    def text(self) -> str:
        """The optimizer in words: "AdamW", or the class's name and where it comes from."""
        if self.is_adamw:
            return "AdamW"
        module, _, name = self.path.rpartition(".")
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{name}({args}) from {module}"

    def resolve(self) -> type[torch.optim.Optimizer]:
        """The class (AdamW's for memtrain's own).

        Raises:
            ConfigError: a module that is not installed (naming the pip command), a name it lacks, or something
                that is not a ``torch.optim.Optimizer`` subclass.
        """
        if self.is_adamw:
            return torch.optim.AdamW
        return self.cls if self.cls is not None else _import(self.path)

    def hyperparameters(self, *, lr: float, weight_decay: float, betas: tuple[float, float] | None = None,
                        eps: float | None = None) -> dict[str, Any]:
        """The class's keyword arguments: the run's lr, weight decay, betas and eps where the class takes them in
        the same form (two betas; an eps that is one number, not Adafactor's pair), then its own kwargs (which win).
        """
        defaults = _defaults(self.resolve())
        run = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
        takes = {k: v for k, v in run.items() if v is not None and k in defaults
                 and _same_form(defaults[k], v)}
        return {**takes, **dict(self.kwargs)}

    # -- the probes (memtrain.optim.probe steps the class on the CPU) -------------------------------------------
    # NOTE: imported when called: the optim package imports this module (its rules), so this module imports none
    # of it at the top.
    def state_sizes(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
        """Bytes of each tensor of one parameter's state after a step (the step counter included), measured.

        Raises:
            ConfigError: the class cannot step a CPU tensor (e.g. a CUDA-only kernel), naming the class.
        """
        from memtrain.optim import probe

        return probe.state_sizes(self.resolve(), self.kwargs, shape, dtype)

    def state_bytes(self, shape: tuple[int, ...], dtype: torch.dtype, round_to: int = 1) -> int:
        """One parameter's state bytes, each tensor rounded up to ``round_to`` (the allocator's block)."""
        return sum(-(-n // round_to) * round_to for n in self.state_sizes(shape, dtype))

    def step_scratch(self, dtype: torch.dtype, *, foreach: bool) -> float:
        """Transient bytes per parameter element of one step (what the step allocates and frees), measured on
        ``PROBE_NUMEL`` elements; ``foreach``: the multi-tensor implementation (torch's default on CUDA)."""
        from memtrain.optim import probe

        return probe.scratch_per_element(self.resolve(), self.kwargs, dtype, foreach)

    def takes_foreach(self) -> bool:
        """Whether the class has a multi-tensor implementation to choose (a ``foreach`` argument)."""
        from memtrain.optim import probe

        return "foreach" in probe.parameter_names(self.resolve()) and "foreach" not in dict(self.kwargs)

    def step_time_ratio(self) -> float:
        """Its CPU step's time over torch's fused fp32 AdamW's on ``PROBE_NUMEL`` fp32 elements (best of 5)."""
        from memtrain.optim import probe

        return probe.time_ratio(self.resolve(), self.kwargs)


def _public_path(cls: type) -> str:
    """The shortest dotted path that imports ``cls`` (``torch.optim.SGD``, not ``torch.optim.sgd.SGD``)."""
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):
        module = ".".join(parts[:i])
        try:
            if getattr(importlib.import_module(module), cls.__qualname__, None) is cls:
                return f"{module}.{cls.__qualname__}"
        except ImportError:
            continue
    return f"{cls.__module__}.{cls.__qualname__}"


def _frozen(kwargs: Mapping[str, Any] | tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    items = kwargs.items() if isinstance(kwargs, Mapping) else kwargs
    return tuple(sorted((str(k), _frozen_value(v)) for k, v in items))


class FrozenMapping(dict):
    """A mapping-valued keyword argument of an optimizer class, hashable (the name is a frozen value, the probes
    cache by it) and still the dict the class takes; never changed after it is made."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))


def _frozen_value(value: Any) -> Any:
    """A keyword argument's value made hashable: a list or tuple as a tuple, a mapping as a ``FrozenMapping``, each
    item likewise."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen_value(v) for v in value)
    if isinstance(value, Mapping):
        return FrozenMapping({str(k): _frozen_value(v) for k, v in value.items()})
    return value


@functools.cache
def _import(path: str) -> type[torch.optim.Optimizer]:
    module_name, _, name = path.rpartition(".")
    fix = (f"pass 'adamw', a short name ({', '.join(sorted(ALIASES))}) or the dotted path of a "
           "torch.optim.Optimizer class")
    if not module_name:
        raise ConfigError(f"{path!r} is neither memtrain's 'adamw', a short name nor a dotted path. To resolve this "
                          f"error, {fix}.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        top = module_name.split(".")[0]
        install = EXTRAS.get(top, f"pip install {top}")
        raise ConfigError(f"module {module_name!r} cannot be imported ({e}). To resolve this error, install it "
                          f"({install}) or {fix}.") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"{module_name} has no torch.optim.Optimizer class {name!r}. To resolve this error, "
                          f"{fix}.")
    return cls


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """The class's keyword arguments and their defaults (``inspect.Parameter.empty`` where none)."""
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) and n != "self"}


def _same_form(default: Any, value: Any) -> bool:
    """Whether ``value`` has the form of the class's ``default``: a number for a number (or for no default), two
    numbers for two numbers (betas; not a 3-tuple, not Adafactor's eps pair)."""
    if isinstance(default, tuple):
        return isinstance(value, tuple) and len(value) == len(default) and None not in default
    return not isinstance(value, tuple)


Placement = Literal["device", "offload"]
StatePrecision = Literal["fp32", "bf16", "int8"]
PLACEMENTS: tuple[Placement, ...] = ("device", "offload")
STATE_PRECISIONS: tuple[StatePrecision, ...] = ("fp32", "bf16", "int8")
OFFLOADED = ("offload", "offload-bf16-weights")  # the planner's placements that keep all of the state in host RAM
# Classes whose step needs every gradient at once (or a closure), so a parameter cannot step alone in backward.
NOT_PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.LBFGS,)


def _per_parameter(named: NamedOptimizer | None) -> bool:
    if named is None or named.is_adamw:
        return True
    try:
        cls = named.resolve()
    except ConfigError:
        return True  # a class that does not resolve is refused for that, where it is named
    return not issubclass(cls, NOT_PER_PARAMETER)


# -- the rules ---------------------------------------------------------------------------------------------------
GRADIENTS_BEFORE_DDP = Rule(
    "gradients-before-ddp",
    "DDP averages gradients after the hooks that act on them (a step in backward, a partial offload, gradients "
    "offloaded as produced), so each rank would step on its own gradient and the ranks' weights would drift apart.",
    "drop {but_last}, or run one process",
    ("step_in_backward", "offload_fraction", "processes"),
    lambda s: s.several_processes and bool(s.step_in_backward or s.offload_fraction))
OFFLOAD_OPTIMIZER_FSDP = Rule(
    "offload-optimizer-fsdp",
    "FSDP2 shards the optimizer state itself and CPUOffloadOptimizer needs whole parameters.",
    "drop one of {first} and {rest} (the optimizer on the device with FSDP2, or offloaded with DDP)",
    ("placement", "fsdp"),
    lambda s: s.placement in OFFLOADED and bool(s.fsdp))
OFFLOAD_WITH_FRACTION = Rule(
    "offload-with-fraction",
    "the first puts all of the optimizer state in host RAM, the second a share of a device optimizer's.",
    "pass one of them",
    ("placement", "offload_fraction"),
    lambda s: s.placement in OFFLOADED and s.offload_fraction is not None, shows_false=("offload_fraction",))
OFFLOAD_WITH_IN_BACKWARD = Rule(
    "offload-with-step-in-backward",
    "the offloaded optimizer already takes each gradient off the device as it is produced and steps on the host; "
    "step_in_backward is for the device optimizer.",
    "pass one of them",
    ("placement", "step_in_backward"),
    lambda s: s.placement in OFFLOADED and bool(s.step_in_backward))
IN_BACKWARD_WITH_FRACTION = Rule(
    "step-in-backward-with-fraction",
    "a partial offload steps after backward.",
    "pass one of them",
    ("step_in_backward", "offload_fraction"),
    lambda s: bool(s.step_in_backward) and bool(s.offload_fraction),
    # NOTE: build_optimizer builds it (the device part steps in backward, the host part after it); the plan's cost
    # model does not, so the choices and the plan refuse it.
    planned_only=True)
IN_BACKWARD_FP16_SCALER = Rule(
    "step-in-backward-fp16-scaler",
    "an overflow must stop the parameters still to step on a flag read on the device, which only fused AdamW (fp32 "
    "moments) takes, not lean moments or another optimizer class.",
    "pass bf16-mixed precision (no scaler) or step_in_backward=False, or AdamW with state_precision='fp32'",
    ("step_in_backward", "precision", "optimizer", "state_precision"),
    lambda s: bool(s.step_in_backward) and s.precision == "fp16-mixed" and (
        s.state_precision not in (None, "fp32") or not s.adamw))
IN_BACKWARD_PER_PARAMETER = Rule(
    "step-in-backward-per-parameter",
    "its step needs every parameter's gradient (or a closure re-evaluating the loss), so a parameter cannot step "
    "alone as its gradient is final.",
    "use AdamW (build_optimizer's default) or pass step_in_backward=False",
    ("step_in_backward", "optimizer"),
    lambda s: bool(s.step_in_backward) and not _per_parameter(s.optimizer))
BF16_WEIGHTS_PRECISION = Rule(
    "bf16-device-weights-precision",
    "its device weights are bf16 casts of the host master, which only bf16-mixed computes in.",
    "pass precision='bf16-mixed', or optimizer 'offload' (fp32 device weights)",
    ("placement", "precision"),
    lambda s: s.placement == "offload-bf16-weights" and s.precision not in (None, "bf16-mixed"))
NAMED_OWN_STATE = Rule(
    "named-optimizer-own-state",
    "lean moments and pure bf16 are memtrain's AdamW's; another optimizer class keeps its own state.",
    "drop {rest}, or use the 'adamw' optimizer",
    ("optimizer", "state_precision", "pure_bf16"),
    lambda s: not s.adamw and (s.state_precision not in (None, "fp32") or bool(s.pure_bf16)))

SETTING_FIELDS = ("placement", "state_precision", "step_in_backward", "offload_fraction", "name", "kwargs")
# How ``Choices`` (and ``OptimizerChoice``) name these fields in messages.
CHOICE_TERMS = Terms(labels={"placement": "optimizer.placement", "state_precision": "optimizer.state_precision",
                             "step_in_backward": "optimizer.step_in_backward",
                             "offload_fraction": "optimizer.offload_fraction", "optimizer": "optimizer.name"})


# -- the setting -------------------------------------------------------------------------------------------------
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
        return cls(**known_fields(cls, values, "optimizer"))

    def problems(self) -> list[str]:
        """Every bad value and contradiction among the optimizer's choices, in words naming the fix."""
        problems = []
        if self.placement not in (None, *PLACEMENTS):
            problems.append(f"optimizer.placement={self.placement!r} is not one of 'device', 'offload', or None (the "
                            "plan decides). To resolve this error, pass one of them.")
        if self.state_precision not in (None, *STATE_PRECISIONS):
            problems.append(f"optimizer.state_precision={self.state_precision!r} is not one of 'fp32', 'bf16', "
                            "'int8', or None (the plan decides). To resolve this error, pass one of them.")
        problems += switch_problems(self, ("step_in_backward",), "optimizer.")
        if self.offload_fraction is not None and not is_fraction(self.offload_fraction):
            problems.append(f"optimizer.offload_fraction={self.offload_fraction!r} must be a fraction in [0, 1], or "
                            "None (the plan decides). To resolve this error, pass e.g. offload_fraction=0.5.")
        if self.kwargs is not None and not isinstance(self.kwargs, (Mapping, tuple)):
            problems.append(f"optimizer.kwargs={self.kwargs!r} is not a mapping of argument names to values. To "
                            "resolve this error, pass e.g. kwargs={'beta2_decay': -0.8}.")
        if problems:
            return problems
        try:
            named = self.named
        except ConfigError as e:
            return [f"optimizer.name={p.removeprefix('optimizer=')}" if p.startswith("optimizer=") else p
                    for p in e.problems]
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


# -- its reason line ---------------------------------------------------------------------------------------------
# The placements in the reasons; an alternative is named by the text before its parenthesis.
PLACEMENT_TEXT = {"device": "AdamW on the device",
                  "offload": "AdamW on the CPU (CPUOffloadOptimizer: fp32 master and state in host RAM)",
                  "offload-bf16-weights": "AdamW on the CPU with bf16 weights on the device (fp32 master in host RAM)"}


def _named(name: str, pure_bf16: bool, named: NamedOptimizer | None = None) -> str:
    """The optimizer's name in the reasons: AdamW's, or the class the run names; pure bf16 (only when asked for)
    has no master anywhere."""
    if named is not None and not named.is_adamw:
        return name.replace("AdamW", named.path.rpartition(".")[2])
    if not pure_bf16:
        return name
    return name.replace("fp32 master and state", "state").replace(
        "AdamW", "pure bf16 AdamW (bf16 weights, no fp32 master, stochastic rounding; as asked)")


def _chosen_text(view: PlanView, s: Any) -> str:
    """The chosen optimizer in words: its placement, then its moments, its step in backward and its offloaded
    share where they are not the plain ones."""
    text = _named(PLACEMENT_TEXT[s.optimizer], s.pure_bf16, s.optimizer_class)
    details = []
    if s.state_precision != "fp32":
        details.append(f"{s.state_precision} moments ({ {'bf16': 4, 'int8': 2}[s.state_precision]} bytes/param, "
                       "not 8)")
    if s.step_in_backward:
        details.append("each parameter stepping in backward, its gradient freed at once"
                       + (" (one backward pass: clipped by the previous step's norm, the first step unclipped)"
                          if view.grad_clip else ""))
    if s.offload_fraction:
        details.append(f"{100 * s.offload_fraction:.0f}% of the state in host RAM")
    if details:
        return f"{text} with {', '.join(details)}"
    if not s.optimizer_class.is_adamw:
        return f"{text} ({s.optimizer_class.text}, as asked: its own state)"
    if s.optimizer == "device" and not s.pure_bf16:
        return f"{text} (fused, fp32 moments)"
    return text


class OptimizerTechnique(Technique):
    """The optimizer's class (named, never planned), placement, moments and step."""

    name = "optimizer"
    fields = ("optimizer",)  # the Choices field this technique owns: an OptimizerChoice, of SETTING_FIELDS
    rules = (GRADIENTS_BEFORE_DDP, OFFLOAD_OPTIMIZER_FSDP, OFFLOAD_WITH_FRACTION, OFFLOAD_WITH_IN_BACKWARD,
             IN_BACKWARD_WITH_FRACTION, IN_BACKWARD_FP16_SCALER, IN_BACKWARD_PER_PARAMETER, BF16_WEIGHTS_PRECISION,
             NAMED_OWN_STATE)
    search = ("offload-optimizer", "bf16-weights", "optimizer-state", "step-in-backward")

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """The optimizer's share of a plan's fixed choices (``choices``: a ``Choices``). Placed on the device (or
        given lean moments, an in-backward step or an offloaded share) it is never offloaded; placed on the device, it
        keeps fp32 weights and no share of its state on the host. Another class keeps its own state: no lean moments
        to search."""
        opt: OptimizerChoice = choices.optimizer
        closed, fraction = set(), opt.offload_fraction
        if opt.placement == "device":
            closed |= {"offload-optimizer", "bf16-weights"}
            fraction = 0.0 if fraction is None else fraction
        named, state_precision = opt.named, opt.state_precision
        if not named.is_adamw:
            closed.add("optimizer-state")
            state_precision = "fp32"
        return Fixing({"optimizer": opt.fixed_placement, "state_precision": state_precision,
                       "step_in_backward": opt.step_in_backward, "offload_fraction": fraction,
                       "optimizer_class": named}, closed)

    def left_open(self, fixed: Any) -> list[str]:
        """What fixes the optimizer where the plan cannot choose it (``fixed``: a plan's ``Fixed``): its placement, and
        on the device (or where the plan could put it there) its moments and its step."""
        on_device = fixed.optimizer != "offload"
        return [text for text, value in (
            ("optimizer.placement='device'", fixed.optimizer),
            ("optimizer.state_precision='fp32'", fixed.state_precision if on_device else "fp32"),
            ("optimizer.step_in_backward=False", fixed.step_in_backward if on_device else False)) if value is None]

    def reasons(self, view: PlanView) -> list[str]:
        """The optimizer (placement, moments, when it steps), against fused fp32 AdamW on the device, the other
        placements, and a leaner device optimizer."""
        s = view.settings
        placement, state = view.column("optimizer"), view.column("state_precision")
        in_backward, fraction = view.column("step_in_backward"), view.column("offload_fraction")
        plain = (placement == "device") & (state == "fp32") & (in_backward == False) & (fraction == 0)  # noqa: E712
        chosen_plain = bool(plain[view.chosen])
        alternatives = []
        if not chosen_plain:
            fused = "fused fp32 AdamW on the device"
            alternatives.append(view.alternative(plain, fused if s.optimizer_class.is_adamw else _named(
                fused, False, s.optimizer_class).replace("fused fp32 ", "")))
        alternatives += [view.alternative(placement == o, _named(PLACEMENT_TEXT[o].split(" (")[0], False,
                                                                 s.optimizer_class)) for o in PLACEMENT_TEXT
                         if o != s.optimizer and o != "device" and (placement == o).any()]
        if chosen_plain and (~plain & (placement == "device")).any():
            alternatives.append(view.alternative(~plain & (placement == "device"), "a leaner device optimizer",
                                                 lean=True))
        alternatives = [a for a in alternatives if a]
        if s.offload_weights and not alternatives:  # the only placement that streamed weights leave
            alternatives = ["parameter offload streams the blocks' weights from its master in host RAM"]
        text = f"optimizer {_chosen_text(view, s)}"
        if alternatives:
            return [f"{text}, because: {'; '.join(alternatives)}"]
        return [text + ("" if view.device == "cuda" else ": on a CPU an offload only copies within RAM")]

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """On the device; on CUDA offloaded too (with bf16 device weights where bf16-mixed computes in them);
        fp32 moments, and bf16 and int8 (where bitsandbytes runs) ones where lean moments are allowed."""
        space.placements = ["device"]
        if problem.cuda and "offload-optimizer" in allowed:
            space.placements.append("offload")
            if "bf16-weights" in allowed and not BF16_WEIGHTS_PRECISION.refuses(
                    SetUp(placement="offload-bf16-weights", precision=problem.precision)):
                space.placements.append("offload-bf16-weights")
        space.states = ["fp32"]
        if "optimizer-state" in allowed:
            space.states += ["bf16", *(["int8"] if problem.int8 else [])]

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        if fixed.optimizer is not None:
            space.placements = [fixed.optimizer]
        if fixed.state_precision is not None:
            space.states = [fixed.state_precision]

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        """The optimizer ``estimate`` traces: the ``optimizer=`` argument, or the class the set-up names, offloaded
        ("adamw-offload", or a named class's whole state in host RAM) where the set-up places it there; and AdamW's
        moments, step and offloaded share. Parameter offload's implied placement is the optimizer's to trace here
        (the options it changes are the optimizer's). Where the set-up and the argument contradict, AdamW's options
        keep their defaults."""
        choice: OptimizerChoice = setup.optimizer
        options: dict[str, Any] = {
            "optimizer": optimizer, "state_precision": choice.state_precision or "fp32",
            "offload_fraction": choice.offload_fraction or 0.0, "step_in_backward": bool(choice.step_in_backward)}
        problems = []
        lean = choice.state_precision not in (None, "fp32") or bool(choice.offload_fraction) or bool(
            choice.step_in_backward)  # memtrain.optim's AdamW rather than torch's
        # Parameter offload streams the weights from the offloaded optimizer's master: it implies that optimizer.
        offloaded = choice.placement == "offload" or (choice.placement is None and bool(setup.offload_weights))
        if not choice.named.is_adamw:  # a named class, wrapped as memtrain's AdamW is (offloaded: all of its state)
            if optimizer != "adamw":
                problems.append(f"setup.optimizer.name={choice.named.path!r} with optimizer={optimizer!r}: two "
                                "optimizers for one step. To resolve this error, pass one of them.")
            options["optimizer"] = choice.named
            if offloaded:
                options["offload_fraction"] = 1.0
        elif offloaded and optimizer == "adamw":
            options["optimizer"] = "adamw-offload"
        elif offloaded and optimizer != "adamw-offload":
            problems.append(f"setup.optimizer.placement='offload' with optimizer={optimizer!r}: the offloaded "
                            "optimizer is AdamW (CPUOffloadOptimizer). To resolve this error, pass optimizer='adamw', "
                            "or drop placement='offload'.")
        elif (choice.placement == "device" or choice.offload_fraction or choice.step_in_backward) and (
                optimizer == "adamw-offload"):  # lean moments go with either placement
            asked = [f"{name}={getattr(choice, name)!r}" for name in ("placement", "state_precision",
                                                                      "step_in_backward", "offload_fraction")
                     if getattr(choice, name)]
            problems.append(f"setup.optimizer {', '.join(asked)} with optimizer='adamw-offload': those choose AdamW "
                            "on the device, 'adamw-offload' puts all of its state in host RAM. To resolve this error, "
                            "pass optimizer='adamw', or drop them.")
        elif lean and optimizer != "adamw":
            problems.append(f"setup.optimizer's state_precision, step_in_backward and offload_fraction are options "
                            f"of AdamW (memtrain.optim), not of optimizer={optimizer!r}. To resolve this error, pass "
                            "optimizer='adamw', or drop them.")
        if problems:
            options.update(state_precision="fp32", offload_fraction=0.0, step_in_backward=False)
        return options, problems

    def trainer_problems(self, choices: Any) -> list[str]:
        """The Trainer builds its own AdamW on the device and steps after backward: lean moments and another class
        only offloaded (``CPUOffloadOptimizer``), no step in backward, no partial offload."""
        optimizer: OptimizerChoice = choices.optimizer
        problems = []
        if optimizer.state_precision is not None and optimizer.placement != "offload":
            problems.append(f"optimizer.state_precision={optimizer.state_precision!r}: the Trainer's AdamW keeps its "
                            "moments in its own dtype; MemtrainTrainer builds memtrain.optim's lean moments only on "
                            "the host. To resolve this error, add placement='offload' (CPUOffloadOptimizer), drop "
                            "state_precision (or train with `memtrain train`, which does).")
        if not optimizer.named.is_adamw and optimizer.placement != "offload":
            problems.append(f"optimizer.name={optimizer.named.path!r} on the device: the Trainer builds its own "
                            "optimizer there. To resolve this error, name it in the TrainingArguments (optim=...) or "
                            "pass Trainer(optimizers=...), or add placement='offload' (CPUOffloadOptimizer steps the "
                            "class on the host).")
        if optimizer.step_in_backward:
            problems.append("optimizer.step_in_backward=True: the Trainer steps after backward and clips through the "
                            "accelerator; MemtrainTrainer cannot step each parameter inside backward. To resolve this "
                            "error, drop step_in_backward (or train with `memtrain train`).")
        if optimizer.offload_fraction:
            problems.append(f"optimizer.offload_fraction={optimizer.offload_fraction}: MemtrainTrainer offloads all "
                            "of the optimizer state or none. To resolve this error, pass "
                            "OptimizerChoice(placement='offload') (all of it) or drop offload_fraction.")
        return problems


TECHNIQUE = OptimizerTechnique()
