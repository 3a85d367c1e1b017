"""An optimizer class by name (``NamedOptimizer``): memtrain's own AdamW (``"adamw"``), a short name (``ALIASES``), a
dotted path or, in Python, the class itself, with the keyword arguments it is built with; resolved when named, so a
missing package is named at start-up (``EXTRAS``: the pip command), and probed for its bytes
(``memtrain.optim.probe``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memtrain.errors import ConfigError
from memtrain.message import arg, marked

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


@dataclass(frozen=True)
class NamedOptimizer:
    """An optimizer class by name, with the keyword arguments it is built with beyond lr and weight decay.

    Attributes:
        path: ``"adamw"`` (memtrain's AdamW) or the class's dotted path; a short name (``ALIASES``) is taken too,
            and resolved to its path as ``of`` resolves it (``NamedOptimizer("lion") == NamedOptimizer.of("lion")``).
        kwargs: the class's own hyper-parameters, e.g. ``(("beta2_decay", -0.8),)``; a mapping is taken by ``of``.
        given: the name as it was given (e.g. ``"lion"``), for messages; None where it is ``path``.
    """

    path: str = ADAMW
    kwargs: tuple[tuple[str, Any], ...] = ()
    cls: type | None = field(default=None, compare=False, repr=False)  # a class given as an object (Python API)
    given: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # The short names resolve here, so the constructor takes every name ``of`` does (and its messages list).
        if isinstance(self.path, str):
            spelt = self.path.strip()
            path = ADAMW if spelt.lower() == ADAMW else ALIASES.get(spelt.lower(), spelt)
            object.__setattr__(self, "path", path)
            if self.given is None and spelt != path:
                object.__setattr__(self, "given", spelt)

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
                                  f"{arg('state_precision')}, {arg('pure_bf16')} and the training config's betas and "
                                  "eps. To resolve this error, drop the kwargs, or name a class (e.g. "
                                  "'torch.optim.AdamW').")
            return NamedOptimizer()
        if isinstance(value, type):
            named = NamedOptimizer(_public_path(value), args, value)
        elif isinstance(value, str) and value.strip():
            named = NamedOptimizer(value.strip(), args)
        else:
            raise ConfigError(f"optimizer={value!r} names no optimizer. To resolve this error, pass 'adamw', a short "
                              f"name ({', '.join(sorted(ALIASES))}), a dotted path such as 'torch.optim.Adafactor', "
                              "or a torch.optim.Optimizer class.")
        try:
            named.resolve()
        except ConfigError as e:
            raise ConfigError(f"optimizer={value!r}: {marked(e.problems[0])}") from None
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
    def spelling(self) -> str:
        """The optimizer as it was named: the short name given (``"lion"``), else the path."""
        return self.given or self.path

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
