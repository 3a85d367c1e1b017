"""The offloaded optimizer's host side: flat (pinned) buffers, one slot per parameter, buckets, the host-RAM check.

CPUOffloadOptimizer (``memtrain.optim.offload``) lays each parameter's fp32 master, gradient buffers and cast
buffers out as views of a few large flat host tensors, pinned where a GPU exists. This module sizes and builds
them (after checking the machine's free RAM), validates the parameters and the class, and keeps the register of which live
optimizer owns each parameter.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from memtrain.device import Accelerator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.measure import available_host_bytes
from memtrain.message import arg
from memtrain.optim.moments import BF16StateAdamW
from memtrain.optim.pure_bf16 import PureBF16AdamW
from memtrain.report import format_bytes

# Group keys that choose an implementation rather than the maths: they stay with each side's own optimizer when a
# state_dict moves between this class and a plain one (a device AdamW's fused=True must not reach the host one).
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
# Bytes of optimizer state per parameter assumed for the host-RAM check (exact for Adam/AdamW without amsgrad).
STATE_BYTES_PER_PARAM = {torch.optim.Adam: 8, torch.optim.AdamW: 8, torch.optim.SGD: 4}


@dataclass(eq=False)
class Slot:
    """One parameter: its device tensor and its host views (fp32 master, gradient buffers, cast buffer)."""

    key: int | str  # its key in state_dict(): the parameter's name when known, else its index
    group: int  # index in param_groups
    device: torch.Tensor
    master: torch.Tensor  # fp32 host weights; also the parameter the wrapped optimizer steps
    grads: tuple[torch.Tensor, ...]  # one host gradient buffer, two with delayed_update
    cast: torch.Tensor | None  # pinned host copy in the device dtype, when that is not fp32 (halves PCIe bytes)
    # Pinned host buffer the device-dtype gradient lands in before the worker casts (or adds) it into ``grads``:
    # owned and counted in the host-RAM check, not torch's pinned cache (rounded up to powers of two, kept).
    stage: torch.Tensor | None = None
    reader: Future[None] | None = None  # the worker task still reading ``stage``
    has_grad: bool = False
    zeroed: bool = False  # the host buffer holds zeros (zero_grad(set_to_none=False)): copy, don't add
    # 2-norm of the host gradient, taken by the worker as it lands; written only by the worker (in task order), or
    # by the loop's thread once no task is pending.
    norm: torch.Tensor | None = None
    landings: int = 0  # backwards that landed a gradient in this window
    bucket: int = -1


@dataclass(eq=False)
class Landing:
    """One gradient copied device -> host, whose host side (add or cast, norm) the worker finishes."""

    slot: Slot
    dst: torch.Tensor
    staged: torch.Tensor | None  # the copied gradient, when it must be added or cast into dst
    copy: bool  # staged replaces dst (first landing of the window) instead of adding to it
    want_norm: bool
    sum_half: int | None = None  # staged is a view of this half of the sum stage


@dataclass(eq=False)
class SumStage:
    """Where a later micro-batch's gradient lands (in the host buffers' dtype) before the landing worker adds it:
    two pinned halves filled in turn, each at least the largest parameter and about a quarter of the parameters
    (at most a bucket), so that one half takes copies while the landing worker adds the other's. Replaces torch's
    pinned cache (each copy a power-of-two block, kept for the process's life, invisible to the host-RAM check).

    A half is reused only once every landing staged in it was handed to the landing worker and read.
    """

    halves: tuple[torch.Tensor, torch.Tensor]
    current: int = 0  # the half being filled
    used: int = 0  # its elements taken
    owners: tuple[set[int], set[int]] = field(default_factory=lambda: (set(), set()))  # buckets staged in each
    reader: list[Future[None] | None] = field(default_factory=lambda: [None, None])  # last task reading each

    def take(self, n: int) -> tuple[int, int] | None:
        """(half, offset) of ``n`` more elements in the current half, or None when it is full."""
        if self.used + aligned(n) > self.halves[0].numel():
            return None
        place = (self.current, self.used)
        self.used += aligned(n)
        return place


def sum_stage_numel(numels: list[int], bucket_numel: int) -> int:
    """Elements of one sum stage half over parameters of ``numels``: the largest parameter, or a quarter of them
    all if more (at most ``bucket_numel``); aligned as laid out. Pure, for byte models."""
    if not numels:
        return 0
    quarter = aligned(sum(aligned(n) for n in numels) // 4)
    return max(max(aligned(n) for n in numels), min(quarter, aligned(bucket_numel)))


def own_sum_stage(numel: int, dtype: torch.dtype, acc: Accelerator) -> tuple[SumStage, int]:
    """The sum stage (two halves of ``numel`` elements, one pinned slab at its exact size) and its bytes, after
    checking the host RAM."""
    need = 2 * numel * torch.empty((), dtype=dtype).element_size()
    available = available_host_bytes()
    if available is not None and need > available:
        raise MemtrainError(
            f"CPUOffloadOptimizer needs {format_bytes(need)} of host RAM for the stage a later micro-batch's "
            f"gradients land in, but only {format_bytes(available)} is available. To resolve this error, free host "
            "memory, or train with one micro-batch per step.")
    halves = acc.host_buffer(2 * numel, dtype).split(numel)
    return SumStage((halves[0], halves[1])), need


@dataclass(eq=False)
class Bucket:
    """Parameters stepped together: one wrapped optimizer each, so a bucket's weights can go back early."""

    slots: list[Slot]
    inner: torch.optim.Optimizer
    group_of: list[int]  # inner group i mirrors param_groups[group_of[i]]


def release(hooks: list[Any], workers: tuple[ThreadPoolExecutor, ...], params: list[torch.Tensor]) -> None:
    for handle in hooks:
        handle.remove()
    for p in params:
        entry = _OWNERS.get(id(p))
        if entry is not None and entry[0]() is p:
            del _OWNERS[id(p)]
    for worker in workers:
        worker.shutdown(wait=False)


def host_work(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs an optimizer method inside its device seam's ``host()`` region: the scalars and flags the loop's thread
    makes there (norms, multipliers, inf flags) are host memory, not device memory, under the simulated ledger."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._acc.host():
            return method(self, *args, **kwargs)

    return wrapper


# Each parameter's optimizer, weakly both ways (keyed by id: tensors compare by value, not identity). A second live
# optimizer over the same parameter is refused.
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.optim.Optimizer]]] = {}


def _owner(p: torch.Tensor) -> torch.optim.Optimizer | None:
    entry = _OWNERS.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def claim(p: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    key = id(p)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:  # the parameter is gone
        if _OWNERS.get(key, (None,))[0] is ref:
            del _OWNERS[key]

    _OWNERS[key] = (weakref.ref(p, forget), weakref.ref(optimizer))


DIRECTIONS = ("device_to_host", "host_to_device")


class Link:
    """One CPUOffloadOptimizer's link to host memory: a side stream per direction (``DIRECTIONS``) and the bytes
    that crossed each way over the run. Its landings copy the gradients down on one and its stepper the weights
    back up on the other, so the copies back of a delayed update run beside the next backward's gradient copies
    instead of queueing behind them, and the two PCIe directions overlap.

    Args:
        acc: the device seam every copy, stream and event goes through.
        streams: whether to make the side streams (where the device has streams); without them (the plain CPU)
            each direction's stream is None and copies run in order.
    """

    def __init__(self, acc: Accelerator, *, streams: bool):
        self.acc = acc
        self.streams: dict[str, Any] = {d: acc.new_stream() if streams else None for d in DIRECTIONS}
        self.bytes = dict.fromkeys(DIRECTIONS, 0)  # crossed (or, on a CPU-only run, would cross) each way

    def side_stream(self, direction: str) -> Any:
        """The context a copy over the link is issued in: ``direction``'s own side stream (none on the CPU)."""
        return self.acc.use_stream(self.streams[direction])


def bucket_runs(numels: list[int], bucket_numel: int) -> list[list[int]]:
    """How CPUOffloadOptimizer groups parameters (given in its bucket order) into buckets: runs of indices whose
    numels add up to at most ``bucket_numel`` (a larger parameter gets a bucket of its own). Pure, for byte models."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(numels):
        if runs[-1] and total + n > bucket_numel:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return runs


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """An outer param group's hyper-parameters: what its host optimizer's group copies."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def make_buckets(slots: list[Slot], by_place: list[Slot], param_groups: list[dict[str, Any]],
                 optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                 bucket_numel: int, first_salt: int = 0) -> list[Bucket]:
    """``slots`` (in bucket order: reverse registration) in runs of at most ``bucket_numel`` elements, one
    ``optimizer_class`` over each run's masters, its groups mirroring ``param_groups``; sets each slot's ``bucket``.
    ``by_place``: the slots in param_groups order (the bf16 rounding noise is salted by the place there, counted
    from ``first_salt``)."""
    runs = [[slots[i] for i in run] for run in bucket_runs([s.master.numel() for s in slots], bucket_numel)]
    buckets = []
    place = {id(s): i for i, s in enumerate(by_place)}
    for index, run in enumerate(runs):
        for slot in run:
            slot.bucket = index
        group_of = sorted({s.group for s in run})
        inner_groups = [{**hyperparameters(param_groups[gi]), "params": [s.master for s in run if s.group == gi]}
                        for gi in group_of]
        inner = optimizer_class(inner_groups, **optimizer_kwargs)
        if isinstance(inner, (BF16StateAdamW, PureBF16AdamW)):
            # Each parameter's rounding noise salted by its place in param_groups, as the device optimizer
            # salts it: the buckets (reverse order, one optimizer each) then round as one device AdamW would.
            inner.salts = {id(s.master): first_salt + place[id(s)] for s in run}
        buckets.append(Bucket(run, inner, group_of))
    return buckets


def aligned(numel: int) -> int:
    # Every view starts on a 256-byte boundary: the CPU kernels' vector loops then split each tensor the same way
    # as for a separately allocated one, so the rounding (and the result) is bit-identical to a plain optimizer.
    return -(-numel // 64) * 64


def lay_out(flat: list[torch.Tensor], groups: list[dict[str, Any]], names: list[str] | None, *,
            n_grad_buffers: int, device_dtype: torch.dtype | None, acc: Accelerator,
            master_dtype: torch.dtype = torch.float32) -> tuple[dict[int, Slot], list[int]]:
    """The host buffers of ``flat`` and one slot of views into them per parameter (by index in ``flat``), with the
    bucket order; fills each master from its parameter, then casts the device parameter to ``device_dtype``.
    ``master_dtype`` bf16 (pure bf16): the masters are the bf16 weights themselves and the gradient buffers bf16.

    A few large flat buffers, parameters laid out in reverse registration order (roughly the order backward
    produces their gradients) so that a bucket is a contiguous range. Only what crosses PCIe is pinned.
    """
    order = list(reversed(range(len(flat))))
    total = sum(aligned(p.numel()) for p in flat)

    def host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Pinned at its exact size where the device has streams (registered: torch's host allocator would round
        # each request up to a power of two); plain memory on the CPU, where nothing crosses a link.
        return acc.host_buffer(numel, dtype) if acc.has_streams else torch.empty(numel, dtype=dtype)

    master_flat = host_buffer(total, master_dtype)
    # Never read before written: a gradient's first landing copies, later ones add.
    grad_flats = [host_buffer(total, master_dtype) for _ in range(n_grad_buffers)]
    def target(p: torch.Tensor) -> torch.dtype:  # the device parameter's dtype once set up
        return device_dtype if device_dtype is not None and p.is_floating_point() else p.dtype

    cast_numel: dict[torch.dtype, int] = {}
    for p in flat:
        if target(p) != master_dtype:
            cast_numel[target(p)] = cast_numel.get(target(p), 0) + aligned(p.numel())
    cast_flats = {dt: host_buffer(n, dt) for dt, n in cast_numel.items()}
    # NOTE: one buffer serves as both where a step never overlaps a backward (no delayed update): the gradient
    # stage is read (cast into the fp32 buffer) before the step, the cast written after it and copied to the
    # device before the next forward, whose backward alone writes the stage again (the compute stream waits for
    # those copies, the gradient copies for the compute stream). Saves 2 bytes per bf16 parameter of host RAM.
    stage_flats = cast_flats if n_grad_buffers == 1 else {
        dt: host_buffer(n, dt) for dt, n in cast_numel.items()}  # same layout as the casts
    group_index = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    slots: dict[int, Slot] = {}
    offset, cast_offset = 0, dict.fromkeys(cast_flats, 0)
    for i in order:
        p, n = flat[i], flat[i].numel()
        cast = stage = None
        if target(p) in cast_flats:
            start = cast_offset[target(p)]
            cast = cast_flats[target(p)][start:start + n].view(p.shape)
            stage = stage_flats[target(p)][start:start + n].view(p.shape)
            cast_offset[target(p)] += aligned(n)
        slot = Slot(
            key=names[i] if names is not None else i,
            group=group_index[id(p)],
            device=p,
            master=master_flat[offset:offset + n].view(p.shape),
            grads=tuple(g[offset:offset + n].view(p.shape) for g in grad_flats),
            cast=cast,
            stage=stage,
        )
        with torch.no_grad():
            slot.master.copy_(p.detach())
            if target(p) != p.dtype:
                p.data = p.data.to(target(p))  # after the master took the full-precision digits
        slots[i] = slot
        offset += aligned(n)
    return slots, order


def own_stages(slots: list[Slot], acc: Accelerator) -> int:
    """Gives each of ``slots`` a gradient stage of its own (they shared their cast buffer) as views of one host
    slab per dtype, pinned at its exact size where the device has streams; returns the bytes pinned. Checks the
    host RAM first."""
    by_dtype: dict[torch.dtype, list[Slot]] = {}
    for slot in slots:
        by_dtype.setdefault(slot.cast.dtype, []).append(slot)
    sizes = {dt: sum(aligned(s.cast.numel()) for s in group) for dt, group in by_dtype.items()}
    need = sum(n * torch.empty((), dtype=dt).element_size() for dt, n in sizes.items())
    available = available_host_bytes()
    if available is not None and need > available:
        raise MemtrainError(
            f"CPUOffloadOptimizer.stream_weights needs {format_bytes(need)} of host RAM for the gradient stages of "
            f"{len(slots)} streamed parameters, but only {format_bytes(available)} is available. To resolve this "
            "error, free host memory or stream fewer blocks.")
    for dt, group in by_dtype.items():
        slab = acc.host_buffer(sizes[dt], dt) if acc.has_streams else torch.empty(sizes[dt], dtype=dt)
        offset = 0
        for slot in group:
            n = slot.cast.numel()
            slot.stage = slab[offset:offset + n].view(slot.cast.shape)
            offset += aligned(n)
    return need if acc.has_streams else 0


# -- validation ---------------------------------------------------------------------------------------------
def parse_params(params: Iterable[Any], optimizer_class: Any) -> tuple[list[dict[str, Any]], list[str] | None]:
    """Normalises params into groups of plain tensors and names (None unless every parameter is named)."""
    problems = []
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer_class={optimizer_class!r} is not a torch.optim.Optimizer subclass. To resolve "
                          "this error, pass a class such as torch.optim.AdamW (the class, not an instance).")
    if isinstance(params, torch.Tensor):
        params = [params]
    items = list(params)
    raw_groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    groups: list[dict[str, Any]] = []
    names: list[str | None] = []
    for g in raw_groups:
        if not isinstance(g, dict):
            raise ConfigError("params mixes parameter groups (dicts) with parameters. To resolve this error, pass "
                              "either a list of parameters or a list of groups.")
        entries = [g["params"]] if isinstance(g.get("params"), torch.Tensor) else list(g.get("params", []))
        tensors = []
        for e in entries:
            name, p = (e if isinstance(e, tuple) and len(e) == 2 else (None, e))
            tensors.append(p)
            names.append(name)
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": tensors})
    flat = [p for g in groups for p in g["params"]]
    if not flat:
        raise ConfigError("CPUOffloadOptimizer got no parameters. To resolve this error, pass model.parameters() "
                          "(check that the model has parameters and that a generator was not consumed before).")
    label = [str(n) if n is not None else f"#{i}" for i, n in enumerate(names)]
    not_tensors = [lbl for lbl, p in zip(label, flat, strict=True) if not isinstance(p, torch.Tensor)]
    if not_tensors:
        raise ConfigError(f"params {not_tensors[:5]} are not tensors. To resolve this error, pass model.parameters() "
                          "or model.named_parameters().")
    frozen = [lbl for lbl, p in zip(label, flat, strict=True) if not p.requires_grad]
    if frozen:
        problems.append(f"{len(frozen)} parameters do not require grad ({frozen[:5]}): they would take host buffers "
                        "and never get a gradient. To resolve this error, pass only trainable ones: "
                        "[p for p in model.parameters() if p.requires_grad].")
    devices = sorted({str(p.device) for p in flat})
    if len(devices) > 1:
        problems.append(f"the parameters live on several devices ({', '.join(devices)}); one set of streams and "
                        "buffers serves one device. To resolve this error, build one CPUOffloadOptimizer per device.")
    not_float = sorted({str(p.dtype) for p in flat if not p.is_floating_point()})
    if not_float:
        problems.append(f"parameters of dtype {not_float} cannot be optimized. To resolve this error, pass floating-"
                        "point parameters only.")
    if any(p.layout != torch.strided for p in flat):
        problems.append("sparse parameters are not supported. To resolve this error, use dense parameters.")
    if len({id(p) for p in flat}) != len(flat):
        problems.append("a parameter appears more than once in params: it would get two host copies and two "
                        "gradient hooks. To resolve this error, pass each parameter once (model.parameters() "
                        "already lists tied weights once).")
    owned = [lbl for lbl, p in zip(label, flat, strict=True) if _owner(p) is not None]
    if owned:
        problems.append(f"parameters {owned[:5]} already belong to another live CPUOffloadOptimizer, whose hooks "
                        "take their gradients in backward. To resolve this error, call old_optimizer.close() first.")
    ConfigError.raise_if(problems)
    named = all(n is not None for n in names)
    return groups, ([str(n) for n in names] if named else None)


def group_indices(groups: list[dict[str, Any]]) -> list[list[int]]:
    out, i = [], 0
    for g in groups:
        out.append(list(range(i, i + len(g["params"]))))
        i += len(g["params"])
    return out


def host_buffer_bytes(flat: list[torch.Tensor], *, n_grad_buffers: int,
                      device_dtype: torch.dtype | None = None, master_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of CPUOffloadOptimizer's host buffers over ``flat`` (state aside): fp32 masters, the gradient
    buffers, and for parameters whose device dtype is not fp32 a cast buffer in that dtype, which is also the
    gradient stage (a second one with two gradient buffers: a delayed update). Pure bf16 (``master_dtype`` bf16):
    bf16 masters and gradient buffers, no cast."""
    numel = sum(aligned(p.numel()) for p in flat)
    cast = 0
    for p in flat:
        dtype = device_dtype if device_dtype is not None and p.is_floating_point() else p.dtype
        if dtype != master_dtype:
            cast += aligned(p.numel()) * torch.empty((), dtype=dtype).element_size()
    width = torch.empty((), dtype=master_dtype).element_size()
    return width * numel * (1 + n_grad_buffers) + cast * (1 + (n_grad_buffers > 1))


def check_host_ram(flat: list[torch.Tensor], optimizer_class: type, *, n_grad_buffers: int, pin: bool,
                    device_dtype: torch.dtype | None = None, master_dtype: torch.dtype = torch.float32,
                    state_bytes_per_param: float | None = None) -> int:
    """Raises before allocating when the host buffers would not fit in the machine's available RAM
    (``state_bytes_per_param``: the state's bytes a parameter where the class cannot say, e.g. PureBF16AdamW's,
    which depend on its moments' precision). Returns the buffers' bytes (state aside): what is pinned when
    ``pin``, to the byte (registered slabs, no power-of-two rounding)."""
    numel = sum(aligned(p.numel()) for p in flat)
    per_param = state_bytes_per_param or getattr(optimizer_class, "state_bytes_per_param", None)  # lean classes'
    state = int(STATE_BYTES_PER_PARAM.get(optimizer_class, per_param or 8) * numel)
    buffers = host_buffer_bytes(flat, n_grad_buffers=n_grad_buffers, device_dtype=device_dtype,
                                master_dtype=master_dtype)
    need = buffers + state
    available = available_host_bytes()
    if available is not None and need > available:
        raise MemtrainError(
            f"CPUOffloadOptimizer needs {format_bytes(need)} of host RAM ({numel:,} parameters: fp32 master weights "
            f"and {n_grad_buffers} gradient buffer(s){', pinned' if pin else ''} (and cast and gradient stage buffers "
            f"for non-fp32 device weights), plus about {format_bytes(state)} "
            f"of {optimizer_class.__name__} state), but only {format_bytes(available)} is available. To resolve "
            "this error, free host memory, train fewer parameters, or keep the optimizer on the device.")
    return buffers


def check_bf16_weights(flat: list[torch.Tensor], names: list[str] | None) -> None:
    """pure_bf16 keeps no fp32 master: refuses parameters that are not bf16 already."""
    wrong = [names[i] if names else f"#{i}" for i, p in enumerate(flat) if p.dtype != torch.bfloat16]
    if wrong:
        raise ConfigError(
            f"CPUOffloadOptimizer(pure_bf16=True): {len(wrong)} parameters are not bf16 ({wrong[:3]}): pure bf16 "
            "keeps no fp32 master, so the weights must be bf16 already. To resolve this error, cast the model first "
            f"(model.to(torch.bfloat16)), or pass {arg('pure_bf16', False)} (an fp32 master on the host).")


def probe_class(optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
                optimizer_kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``optimizer_class`` over one-element stand-ins of ``groups``: checks the class and its arguments."""
    try:
        template = optimizer_class(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": [torch.zeros(1, requires_grad=True)]}
             for g in groups],
            **optimizer_kwargs,
        )
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{optimizer_class.__name__}({optimizer_kwargs}) rejected its arguments: {e}. To resolve "
                          f"this error, pass only hyper-parameters {optimizer_class.__name__} accepts.") from None
    return template
