"""The optimizer, named: memtrain's AdamW or any ``torch.optim.Optimizer`` class, with its bytes and its step's speed
measured by probe steps, not written as formulas.

memtrain's own AdamW (``"adamw"``: fused fp32 moments, or bf16 / int8 moments, or pure bf16, through
``build_optimizer``) is one entry of the registry; any other class is named by a short name (``ALIASES``), by a
dotted path (``"torch.optim.Adafactor"``, ``"pytorch_optimizer.Lion"``) or, in Python, by the class itself. The
wrappers (host offload, step in backward, a partial offload) take every class alike.

A foreign class's state is measured, not assumed: one step of the class over a parameter of each shape the model
has (on the CPU, at the shape itself up to ``PROBE_NUMEL`` elements; above it, four smaller shapes whose state
fits ``a + b*rows + c*cols + d*rows*cols`` per state tensor, exact for element-wise and factored states such as
Adafactor's; a larger tensor of more dimensions as that many matrices of its last two), and its step's scratch and
time by one step on ``PROBE_NUMEL`` elements beside torch's fused fp32 AdamW.

Example:
    >>> named = NamedOptimizer.of("adafactor")
    >>> named.path, named.resolve().__name__
    ('torch.optim.Adafactor', 'Adafactor')
    >>> named.state_bytes((4096, 4096), torch.float32)  # a row and a column vector, and the step counter
    32772
"""

from __future__ import annotations

import functools
import importlib
import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memtrain.errors import ConfigError
from memtrain.rules import NAMED_OWN_STATE

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
PROBE_NUMEL = 1 << 20  # elements a probe step allocates at most per parameter (4 MiB in fp32)
_FIT_SIDE = 256  # the smaller side of the shapes a large parameter's state is fitted from
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

    # -- the probes -----------------------------------------------------------------------------------------
    def state_sizes(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
        """Bytes of each tensor of one parameter's state after a step (the step counter included), measured.

        Raises:
            ConfigError: the class cannot step a CPU tensor (e.g. a CUDA-only kernel), naming the class.
        """
        return _fitted_sizes(self.resolve(), self.kwargs, tuple(int(d) for d in shape), dtype)

    def state_bytes(self, shape: tuple[int, ...], dtype: torch.dtype, round_to: int = 1) -> int:
        """One parameter's state bytes, each tensor rounded up to ``round_to`` (the allocator's block)."""
        return sum(-(-n // round_to) * round_to for n in self.state_sizes(shape, dtype))

    def step_scratch(self, dtype: torch.dtype, *, foreach: bool) -> float:
        """Transient bytes per parameter element of one step (what the step allocates and frees), measured on
        ``PROBE_NUMEL`` elements; ``foreach``: the multi-tensor implementation (torch's default on CUDA)."""
        return _scratch_per_element(self.resolve(), self.kwargs, dtype, foreach)

    def takes_foreach(self) -> bool:
        """Whether the class has a multi-tensor implementation to choose (a ``foreach`` argument)."""
        return "foreach" in _parameters(self.resolve()) and "foreach" not in dict(self.kwargs)

    def step_time_ratio(self) -> float:
        """Its CPU step's time over torch's fused fp32 AdamW's on ``PROBE_NUMEL`` fp32 elements (best of 5)."""
        return _time_ratio(self.resolve(), self.kwargs)


def own_state_problems(named: NamedOptimizer, state_precision: str | None, pure_bf16: bool | None,
                       prefix: str = "") -> list[str]:
    """The rule between a named class and memtrain's AdamW's settings, written once: lean moments and pure bf16
    are AdamW's; another class keeps its own state."""
    if named.is_adamw or (state_precision in (None, "fp32") and not pure_bf16):
        return []
    asked = " and ".join(text for text in (
        f"{prefix}state_precision={state_precision!r}" if state_precision not in (None, "fp32") else "",
        "pure_bf16=True" if pure_bf16 else "") if text)
    return [NAMED_OWN_STATE.message(f"optimizer {named.text} with {asked}",
                                    f"drop {asked}, or use the 'adamw' optimizer")]


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
    return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items))


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


@functools.cache
def _parameters(cls: type) -> frozenset[str]:
    params = inspect.signature(cls.__init__).parameters
    return frozenset(n if p.kind is not inspect.Parameter.VAR_KEYWORD else "kwargs" for n, p in params.items())


def _stepped(cls: type, kwargs: tuple[tuple[str, Any], ...], shape: tuple[int, ...], dtype: torch.dtype,
             steps: int = 2) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """``cls`` over one parameter of ``shape`` after ``steps`` steps on a small seeded gradient."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
    p.grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
    args = dict(kwargs)
    if "lr" not in args and "lr" in _parameters(cls):
        args["lr"] = 1e-4
    try:
        opt = cls([p], **args)
        for _ in range(steps):
            opt.step()
    except Exception as e:  # noqa: BLE001 - any failure of a foreign class is reported as one clear error
        raise ConfigError(f"{cls.__module__}.{cls.__qualname__}({dict(kwargs)}) cannot step a {dtype} CPU tensor of "
                          f"shape {shape}: {type(e).__name__}: {e}. memtrain measures an optimizer's state by a probe "
                          "step on the CPU, and the host offload steps there. To resolve this error, pick a class "
                          "with a CPU implementation, or fix its kwargs.") from None
    return opt, p


def _state_sizes(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[int, ...]:
    from memtrain.measure import storage_key

    own = {storage_key(p)[0]}
    if p.grad is not None:
        own.add(storage_key(p.grad)[0])
    sizes: dict[int, int] = {}
    for state in opt.state.values():
        for v in torch.utils._pytree.tree_leaves(state):
            if isinstance(v, torch.Tensor):
                key, nbytes = storage_key(v)
                if key not in own:
                    sizes.setdefault(key, nbytes)
    return tuple(sizes.values())


@functools.cache
def _probe(cls: type, kwargs: tuple[tuple[str, Any], ...], shape: tuple[int, ...],
           dtype: torch.dtype) -> tuple[int, ...]:
    return _state_sizes(*_stepped(cls, kwargs, shape, dtype))


def _fitted_sizes(cls: type, kwargs: tuple[tuple[str, Any], ...], shape: tuple[int, ...],
                  dtype: torch.dtype) -> tuple[int, ...]:
    """The state of a parameter of ``shape``: probed at the shape itself when it is small, else fitted."""
    numel = 1
    for d in shape:
        numel *= d
    if numel <= PROBE_NUMEL:
        return _probe(cls, kwargs, shape, dtype)
    rows, cols = (numel // shape[-1], shape[-1]) if len(shape) >= 2 else (1, numel)
    if rows == 1:  # a long vector: linear in its length
        a = _FIT_SIDE * _FIT_SIDE
        s1, s2 = _probe(cls, kwargs, (a,), dtype), _probe(cls, kwargs, (2 * a,), dtype)
        if len(s1) == len(s2):
            return tuple(x + (y - x) * (numel - a) // a for x, y in zip(s1, s2, strict=True))
        return _scaled(s2, numel, 2 * a)
    if len(shape) > 2:  # leading dimensions: that many (rows, cols) matrices, each with its own state tensors
        lead = numel // (shape[-2] * shape[-1])
        one = _fitted_sizes(cls, kwargs, shape[-2:], dtype)
        # What does not grow with the parameter (a step counter) is one tensor whatever the leading dimensions.
        s1, s2 = _probe(cls, kwargs, (8, 8), dtype), _probe(cls, kwargs, (16, 16), dtype)
        fixed = [x == y for x, y in zip(s1, s2, strict=True)] if len(s1) == len(s2) == len(one) else [False] * len(one)
        return tuple(n if same else n * lead for n, same in zip(one, fixed, strict=True))
    a, b = min(rows, _FIT_SIDE), min(cols, _FIT_SIDE)
    s = [_probe(cls, kwargs, (r, c), dtype) for r, c in ((a, b), (2 * a, b), (a, 2 * b), (2 * a, 2 * b))]
    if len({len(x) for x in s}) != 1:
        return _scaled(s[3], numel, 4 * a * b)
    out = []
    for s11, s21, s12, s22 in zip(*s, strict=True):
        d = (s22 - s21 - s12 + s11) / (a * b)  # per element
        b_row = (s21 - s11) / a - d * b  # per row
        c_col = (s12 - s11) / b - d * a  # per column
        const = s11 - b_row * a - c_col * b - d * a * b
        out.append(round(const + b_row * rows + c_col * cols + d * rows * cols))
    return tuple(out)


def _scaled(sizes: tuple[int, ...], numel: int, probed: int) -> tuple[int, ...]:
    """Probes that disagree on the state's layout: each tensor scaled with the element count (an upper bound for
    states that grow slower than the parameter)."""
    return tuple(-(-n * numel // probed) for n in sizes)


@functools.cache
def _scratch_per_element(cls: type, kwargs: tuple[tuple[str, Any], ...], dtype: torch.dtype,
                         foreach: bool) -> float:
    from memtrain.measure import cpu_allocation_peak_bytes

    args = dict(kwargs)
    if foreach and "foreach" in _parameters(cls) and "foreach" not in args:
        args["foreach"] = True
    opt, p = _stepped(cls, _frozen(args), (PROBE_NUMEL // 1024, 1024), dtype, steps=1)
    return cpu_allocation_peak_bytes(opt.step) / p.numel()


@functools.cache
def _time_ratio(cls: type, kwargs: tuple[tuple[str, Any], ...]) -> float:
    def best(opt: torch.optim.Optimizer) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        return min(times)

    shape = (PROBE_NUMEL // 1024, 1024)
    theirs = best(_stepped(cls, kwargs, shape, torch.float32, steps=1)[0])
    fused = best(_stepped(torch.optim.AdamW, (("fused", True),), shape, torch.float32, steps=1)[0])
    return theirs / fused
