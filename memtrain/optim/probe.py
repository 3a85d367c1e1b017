"""The probes of a named optimizer class: its state's bytes, its step's scratch and its step's time, measured by
stepping the class on the CPU, not written as formulas.

A foreign class's state is measured, not assumed: one step of the class over a parameter of each shape the model
has (on the CPU, at the shape itself up to ``PROBE_NUMEL`` elements; above it, four smaller shapes whose state
fits ``a + b*rows + c*cols + d*rows*cols`` per state tensor, exact for element-wise and factored states such as
Adafactor's; a larger tensor of more dimensions as that many matrices of its last two), and its step's scratch and
time by one step on ``PROBE_NUMEL`` elements beside torch's fused fp32 AdamW. ``NamedOptimizer``
(``memtrain.techniques.optimizer``) asks these for its class.

Example:
    >>> state_sizes(torch.optim.Adafactor, (), (4096, 4096), torch.float32)  # the step counter, a row, a column
    (4, 16384, 16384)
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

import torch

from memtrain.errors import ConfigError
from memtrain.message import words

PROBE_NUMEL = 1 << 20  # elements a probe step allocates at most per parameter (4 MiB in fp32)
_FIT_SIDE = 256  # the smaller side of the shapes a large parameter's state is fitted from
Kwargs = tuple[tuple[str, Any], ...]


@functools.cache
def parameter_names(cls: type) -> frozenset[str]:
    """The names ``cls.__init__`` takes ("kwargs" where it takes any)."""
    params = inspect.signature(cls.__init__).parameters
    return frozenset(n if p.kind is not inspect.Parameter.VAR_KEYWORD else "kwargs" for n, p in params.items())


def state_sizes(cls: type, kwargs: Kwargs, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """Bytes of each tensor of one parameter's state after a step (the step counter included), measured.

    Raises:
        ConfigError: the class cannot step a CPU tensor (e.g. a CUDA-only kernel), naming the class.
    """
    return _fitted_sizes(cls, kwargs, tuple(int(d) for d in shape), dtype)


def scratch_per_element(cls: type, kwargs: Kwargs, dtype: torch.dtype, foreach: bool) -> float:
    """Transient bytes per parameter element of one step (what the step allocates and frees), measured on
    ``PROBE_NUMEL`` elements; ``foreach``: the multi-tensor implementation (torch's default on CUDA)."""
    return _scratch_per_element(cls, kwargs, dtype, foreach)


def time_ratio(cls: type, kwargs: Kwargs) -> float:
    """The class's CPU step's time over torch's fused fp32 AdamW's on ``PROBE_NUMEL`` fp32 elements (best of 5)."""
    return _time_ratio(cls, kwargs)


def _stepped(cls: type, kwargs: tuple[tuple[str, Any], ...], shape: tuple[int, ...], dtype: torch.dtype,
             steps: int = 2) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """``cls`` over one parameter of ``shape`` after ``steps`` steps on a small seeded gradient."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
    p.grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
    args = dict(kwargs)
    if "lr" not in args and "lr" in parameter_names(cls):
        args["lr"] = 1e-4
    try:
        opt = cls([p], **args)
        for _ in range(steps):
            opt.step()
    except Exception as e:  # noqa: BLE001 - any failure of a foreign class is reported as one clear error
        raise ConfigError(f"{cls.__module__}.{cls.__qualname__}({dict(kwargs)}) cannot step a {dtype} CPU tensor of "
                          f"shape {shape}: {type(e).__name__}: {e}. memtrain measures an optimizer's state by a probe "
                          "step on the CPU, and the host offload steps there. To resolve this error, pick a class "
                          f"with a CPU implementation, or {words('fix its kwargs', 'fix its --optimizer-arg values')}.") from None
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
    if foreach and "foreach" in parameter_names(cls) and "foreach" not in args:
        args["foreach"] = True
    opt, p = _stepped(cls, tuple(sorted(args.items())), (PROBE_NUMEL // 1024, 1024), dtype, steps=1)
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
