"""Exact memory measurement of a training step: what autograd saves, what the model state holds.

Activations are counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for
backward passes through the hook, and is counted once per storage (views and tensors saved twice count once).
Parameters and buffers that ops save (a Linear saves its weight) are model state, not activations, and are left
out. This works on any device, the CPU included, so it is the figure CI checks. On CUDA the meter also reads the
caching allocator: the peak over the step and the bytes allocated at each phase boundary.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memtrain.device import Accelerator, RealAccelerator, SimulatedAccelerator, accelerator
from memtrain.errors import MemtrainError
from memtrain.quantize import quant_state_tensors
from memtrain.report import MemoryReport

# Meters that are counting right now. Selective checkpointing keeps some op outputs outside autograd's
# saved-tensor path; it reports them here through ``note_saved`` so that they are counted too.
_ACTIVE_METERS: list[MemoryMeter] = []


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Identity of the storage behind ``t`` (the StorageImpl), valid on every device including meta."""
    try:
        storage = t.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        # Tensor subclasses without a storage of their own (e.g. wrapper subclasses) count by identity.
        return id(t), t.numel() * t.element_size()


def _tensor_storage_keys(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    keys: dict[int, int] = {}
    for t in tensors:
        key, nbytes = storage_key(t)
        keys.setdefault(key, nbytes)
    return keys


_PROFILER_LOCK = threading.Lock()


def cpu_allocation_peak_bytes(step: Callable[[], Any]) -> int:
    """The CPU allocator's high-water mark during ``step()`` above what existed before it, from torch.profiler's
    allocation events: every allocation, those inside kernels included (which saved-tensor counting misses)."""
    from torch.profiler import ProfilerActivity, profile

    # One profile at a time: torch's profiler is one per process, so probes from two threads take turns.
    with _PROFILER_LOCK, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


CGROUP_ROOT = "/sys/fs/cgroup"
_NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page count in bytes (about 2**63)


def available_host_bytes(cgroup_root: str | None = None, membership: str = "/proc/self/cgroup") -> int | None:
    """Host memory available to new allocations: the machine's (Linux ``MemAvailable``; elsewhere free physical
    pages), or less where this process's memory cgroup sets a limit (a container's ``--memory``, a Slurm job's
    share): ``cgroup_room_bytes``. None where the machine does not say."""
    free: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = None
    room = cgroup_room_bytes(cgroup_root, membership)
    return free if room is None else room if free is None else min(free, room)


def cgroup_room_bytes(cgroup_root: str | None = None, membership: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroup still lets it allocate: its limit less its usage, the reclaimable page
    cache (``inactive_file``) not counted as used; the least over its own folder and the hierarchy's root. cgroup
    v2 (``memory.max``, ``memory.current``) or v1 (``memory/memory.limit_in_bytes``, ``memory.usage_in_bytes``).
    None where no limit is set (or nothing can be read). ``cgroup_root`` None: ``CGROUP_ROOT``."""
    root = cgroup_root if cgroup_root is not None else CGROUP_ROOT
    own: dict[str, str] = {}  # "" (v2) or "memory" (v1) -> this process's cgroup path
    try:
        with open(membership) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "" or "memory" in controllers.split(","):
                    own["" if controllers == "" else "memory"] = path.lstrip("/")
    except (OSError, ValueError):
        pass
    rooms = []
    for sub, limit_file, usage_file, cache_key in (("", "memory.max", "memory.current", "inactive_file"),
                                                    ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                     "total_inactive_file")):
        for folder in dict.fromkeys(os.path.normpath(os.path.join(root, sub, *p)) for p in ((own.get(sub, ""),), ())):
            limit, usage = _read_int(os.path.join(folder, limit_file)), _read_int(os.path.join(folder, usage_file))
            if limit is None or limit >= _NO_CGROUP_LIMIT or usage is None:
                continue
            cache = 0
            try:
                with open(os.path.join(folder, "memory.stat")) as f:
                    cache = next((int(v) for k, v in (line.split() for line in f) if k == cache_key), 0)
            except (OSError, ValueError):
                pass
            rooms.append(max(0, limit - max(0, usage - cache)))
    return min(rooms, default=None)


def _read_int(path: str) -> int | None:
    """The integer in a one-line file; None where it is missing or not a number ("max": no limit)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def metering() -> bool:
    """Whether a ``MemoryMeter`` is counting now (so that callers of ``note_saved`` skip their work otherwise)."""
    return bool(_ACTIVE_METERS)


def note_saved(obj: Any) -> None:
    """Counts tensors that are kept for backward outside autograd's saved-tensor hooks (internal)."""
    for meter in _ACTIVE_METERS:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor):
                meter._count(t)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor held in ``optimizer.state``, each storage once (host-resident state included).

    Tensor subclasses that wrap others (torchao's 8-bit and 4-bit optimizer states, DTensor shards) count the
    tensors they hold (codes, scales, code books, the local shard), not their apparent dtype and shape.
    """
    if optimizer is None:
        return 0
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def inner(t: torch.Tensor) -> list[torch.Tensor]:
        if not is_traceable_wrapper_subclass(t):
            return [t]
        names, _ = t.__tensor_flatten__()
        held = [getattr(t, name) for name in names]
        return [leaf for h in held if isinstance(h, torch.Tensor) for leaf in inner(h)]

    tensors = [leaf for state in optimizer.state.values() for v in tree_leaves(state) if isinstance(v, torch.Tensor)
               for leaf in inner(v)]
    return sum(_tensor_storage_keys(tensors).values())


class MemoryMeter:
    """Counts the exact bytes of a training step: parameters, gradients, optimizer state, saved activations.

    Use it as a context around forward and backward; call ``mark(phase)`` at phase boundaries (on CUDA it records
    the allocated bytes there) and ``report()`` afterwards.

    Args:
        model: the model being trained; its parameters and buffers are model state, never activations. Without
            it, leaf tensors that require grad (and views of them) are treated as parameters.
        optimizer: counted for optimizer-state bytes, if given.
        synchronize: on CUDA, wait for the device at entry and at each ``mark`` (what ``measure`` does, so that
            each phase's bytes follow its own kernels). False never stalls the queue: a training loop's meter
            reads the allocator's counters as they are, which is exact for the peak, since the caching allocator
            counts a block when the host allocates or frees it, not when kernels run.

    Example:
        >>> model = torch.nn.Linear(4, 3)
        >>> with MemoryMeter(model) as meter:
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> meter.report().activation_bytes  # the saved input: 2 x 4 x 4 bytes
        32
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                 synchronize: bool = True):
        self.model = model
        self.optimizer = optimizer
        self.synchronize = synchronize
        self._state_keys: dict[int, int] = {}
        self._saved: dict[int, int] = {}
        self._phases: list[tuple[str, int, int]] = []  # (phase, allocated, running max) on an accelerator
        self._peak_reserved: int | None = None  # the allocator's peak reserved at the last phase boundary
        self._gradient_bytes: int | None = None
        self._hooks: contextlib.AbstractContextManager | None = None
        self._acc: Accelerator | None = None  # the device seam whose allocator counts (None: no allocator peak)
        self._device = "cpu"

    @staticmethod
    def _devices(tensors: list[torch.Tensor]) -> set[torch.device]:
        """The devices of the model's state (one place, so that a CPU test can stand a CUDA model in for it)."""
        return {t.device for t in tensors}

    @staticmethod
    def _tracking(devices: set[torch.device], tensors: list[torch.Tensor]) -> Accelerator | None:
        """The seam of the first of ``devices`` whose allocator counts (an accelerator, a simulated one too); none
        for tensors without data (the estimator's fake and meta tensors)."""
        if any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
            return None
        return next((acc for acc in map(accelerator, sorted(devices, key=str)) if acc.tracks_memory), None)

    # -- counting ---------------------------------------------------------------------------------------
    def _is_model_state(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            # A view of a parameter (``W.t()`` of a linear) is the weights, wherever they live: parameter offload
            # gives them device storage of their own while a block is in use.
            return True
        if self.model is not None:
            return storage_key(t)[0] in self._state_keys
        base = t if t._base is None else t._base
        return base.is_leaf and base.requires_grad

    def _count(self, t: torch.Tensor) -> None:
        if self._is_model_state(t):
            return
        key, nbytes = storage_key(t)
        self._saved.setdefault(key, nbytes)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    # -- context ----------------------------------------------------------------------------------------
    def __enter__(self) -> MemoryMeter:
        if self.model is not None:
            state = [*self.model.parameters(), *self.model.buffers()]
            self._state_keys = _tensor_storage_keys(state)
            devices = self._devices(state)
            self._device = str(next(iter(devices))) if len(devices) == 1 else ", ".join(sorted(map(str, devices)))
            self._acc = self._tracking(devices, state)
        else:
            acc = accelerator()
            self._acc = acc if acc.tracks_memory else None
            self._device = str(acc.device)
        if self._acc is not None:
            if self.synchronize:
                self._acc.synchronize()
            self._acc.reset_peak_memory_stats()
        self._saved.clear()
        self._phases.clear()
        self._peak_reserved = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE_METERS.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE_METERS.remove(self)
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        if self._acc is not None:
            self.mark("end")

    def mark(self, phase: str) -> None:
        """Records a phase boundary ("forward", "backward", "step"). Gradients are counted at "backward"."""
        if phase == "backward":
            self._gradient_bytes = self._current_gradient_bytes()
        if self._acc is not None:
            if self.synchronize:
                self._acc.synchronize()
            self._phases.append((phase, self._acc.memory_allocated(), self._acc.max_memory_allocated()))
            self._peak_reserved = self._acc.max_memory_reserved()

    # -- results ----------------------------------------------------------------------------------------
    @property
    def activation_bytes(self) -> int:
        """Bytes saved for backward so far, each storage once."""
        return sum(self._saved.values())

    def _current_gradient_bytes(self) -> int:
        if self.model is None:
            return 0
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return sum(_tensor_storage_keys(grads).values())

    def report(self) -> MemoryReport:
        """The breakdown of what was measured, as a frozen ``MemoryReport``."""
        parameter_bytes = 0
        if self.model is not None:
            # A 4-bit weight's bytes include its quantisation state (absmax, code book), which is no parameter.
            state = [*self.model.parameters(), *quant_state_tensors(self.model)]
            parameter_bytes = sum(_tensor_storage_keys(state).values())
        gradient_bytes = self._gradient_bytes if self._gradient_bytes is not None else self._current_gradient_bytes()
        peak_bytes = peak_phase = None
        phase_bytes: tuple[tuple[str, int], ...] = ()
        if self._phases:
            peak_bytes = self._phases[-1][2]
            # The peak happened in the first phase whose running maximum already reached it.
            peak_phase = next(name for name, _, running in self._phases if running == peak_bytes)
            phase_bytes = tuple((name, allocated) for name, allocated, _ in self._phases if name != "end")
        return MemoryReport(
            parameter_bytes=parameter_bytes,
            gradient_bytes=gradient_bytes,
            optimizer_state_bytes=optimizer_state_bytes(self.optimizer),
            activation_bytes=self.activation_bytes,
            activation_tensors=len(self._saved),
            device=self._device,
            source="measured",
            peak_bytes=peak_bytes,
            peak_phase=peak_phase,
            phase_bytes=phase_bytes,
            reserved_bytes=self._peak_reserved if self._phases else None,
        )


def as_loss(out: Any, who: str = "measure: fn") -> torch.Tensor:
    """The scalar to call backward on: a scalar output, an output's ``.loss``, or the sum of the first tensor of the
    output (itself, or the first of a tuple, list or mapping: e.g. a Hugging Face ``ModelOutput`` without a loss,
    such as ``BertModel``'s ``last_hidden_state``). ``who`` names the caller in the error."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        # A non-scalar output stands in for a loss whose gradient is all ones: same saved tensors.
        return out if out.dim() == 0 else out.float().sum()
    first = next(iter(out.values() if isinstance(out, Mapping) else out), None) if isinstance(
        out, (Mapping, tuple, list)) else None
    if isinstance(first, torch.Tensor):
        return as_loss(first, who)
    raise MemtrainError(
        f"{who} returned {type(out).__name__}, which is not a tensor, an object with a .loss tensor, or a tuple, list "
        "or mapping whose first entry is a tensor: there is no loss to call backward on. To resolve this error, make "
        "it return the loss (or the model output) as a tensor."
    )


def measure(
    fn: Callable[..., Any],
    *args: Any,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **kwargs: Any,
) -> MemoryReport:
    """Runs one forward and backward of ``fn(*args, **kwargs)`` (and an optimizer step) and reports its bytes.

    The loss is ``fn``'s output when it is a scalar, its ``.loss`` (Hugging Face outputs), or the sum of a
    tensor output.

    Args:
        fn: the model, or a function running forward and returning the loss or output.
        *args, **kwargs: passed to ``fn``.
        model: whose parameters and buffers are model state; defaults to ``fn`` when it is a module.
        optimizer: when given, ``optimizer.step()`` runs after backward and its state is counted.

    Returns:
        A ``MemoryReport``; on CUDA with the allocator peak and phase bytes (forward, backward, step).

    Example:
        >>> layer = torch.nn.Linear(16, 8)
        >>> measure(layer, torch.randn(4, 16)).activation_bytes  # 4 x 16 x 4 bytes of saved input
        256
    """
    if model is None and isinstance(fn, nn.Module):
        model = fn
    with MemoryMeter(model, optimizer) as meter:
        loss = as_loss(fn(*args, **kwargs))
        meter.mark("forward")
        loss.backward()
        meter.mark("backward")
        if optimizer is not None:
            optimizer.step()
            meter.mark("step")
    return meter.report()



@dataclass(frozen=True)
class CompileCounts:
    """What torch.compile made of a step: a graph break or a frame left eager means code that runs uncompiled."""

    graphs: int  # distinct graphs dynamo captured
    graph_breaks: int  # graph breaks dynamo recorded (a break inside a loop also skips the frame)
    eager_frames: int  # frames dynamo tried and gave up on: they ran eagerly
    reasons: tuple[str, ...]  # the first line of each break's reason

    def __str__(self) -> str:
        return (f"{self.graphs} graphs, {self.graph_breaks} graph breaks, {self.eager_frames} frames eager"
                + "".join(f"\n  break: {r}" for r in self.reasons))


def compile_counts(step: Callable[[], Any]) -> CompileCounts:
    """Compiles and runs ``step()`` from a fresh dynamo cache and counts its graphs and graph breaks.

    ``step`` calls the ``torch.compile``d model (forward and backward); its first call compiles, so dynamo's
    counters then describe every frame of it. The cache is reset first (earlier compilations would be reused
    uncounted) and after (a count leaves nothing behind).

    Example:
        >>> model = torch.compile(torch.nn.Linear(4, 4), backend="eager")
        >>> compile_counts(lambda: model(torch.randn(2, 4)).sum().backward()).graph_breaks
        0
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        step()
        frames = counters["frames"]
        breaks = counters["graph_break"]
        return CompileCounts(
            graphs=counters["stats"]["unique_graphs"],
            graph_breaks=sum(breaks.values()),
            eager_frames=frames["total"] - frames["ok"],
            reasons=tuple(dict.fromkeys(reason.strip().splitlines()[0] for reason in breaks)),
        )
    finally:
        counters.clear()
        torch._dynamo.reset()


# -- host syncs ---------------------------------------------------------------------------------------------
_SYNC_CALLS = ((torch.Tensor, "item"), (torch.Tensor, "cpu"), (torch.Tensor, "tolist"), (torch.Tensor, "__bool__"),
               (torch.Tensor, "__float__"), (torch.Tensor, "__int__"), (torch.Tensor, "nonzero"), (torch, "nonzero"),
               (torch.cuda, "synchronize"), (RealAccelerator, "synchronize"), (SimulatedAccelerator, "synchronize"),
               (RealAccelerator, "synchronize_event"), (SimulatedAccelerator, "synchronize_event"))
_MISSING = object()


@dataclass
class HostSyncs:
    """Calls that make the host wait for the device, counted by ``count_host_syncs``: their names in order, and
    per call site (``"Tensor.item memtrain/optim/partial.py:123"``) how many."""

    calls: list[str] = field(default_factory=list)
    sites: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return len(self.calls)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Counts, on this thread, the calls that synchronise the host with the device: ``Tensor.item``, ``.cpu``,
    ``.tolist``, ``bool(tensor)``, ``float(tensor)``, ``int(tensor)``, ``nonzero`` (its output size is
    data-dependent), ``torch.cuda.synchronize`` and the device seam's ``synchronize`` and ``synchronize_event``.

    Every tensor counts, whatever its device: on a CPU-only machine the "device" is the CPU, so the count is what
    a GPU run of the same code path would pay at most (a read of a host tensor counts too). Other threads (the
    offloaded optimizer's worker, which steps host tensors) are not counted: the thread that launches the
    device's work is the one a sync stalls.

    Example:
        >>> with count_host_syncs() as syncs:
        ...     _ = torch.ones(2).sum().item()
        >>> syncs.calls
        ['Tensor.item']
    """
    counts = HostSyncs()
    thread = threading.get_ident()
    saved = []
    for owner, name in _SYNC_CALLS:
        original = getattr(owner, name)
        label = f"{'Tensor' if owner is torch.Tensor else owner.__name__}.{name}"

        def counted(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                counts.calls.append(_label)
                caller = sys._getframe(1)
                counts.sites[f"{_label} {_site(caller.f_code.co_filename)}:{caller.f_lineno}"] += 1
            return _original(*args, **kwargs)

        saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, counted)
    try:
        yield counts
    finally:
        for owner, name, own in reversed(saved):
            if own is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def _site(path: str) -> str:
    """A caller's file from its package folder on (memtrain/..., torch/...), else as it is."""
    parts = path.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("memtrain", "torch", "tests", "benchmarks"):
            return "/".join(parts[i:])
    return path


# -- kernel ops -----------------------------------------------------------------------------------------------
# Dispatched ops that run no kernel: tensor allocation (the caching allocator) and the profiler's markers around
# Optimizer.step. Views and other aliasing ops (slices, detach) are counted apart, by their schema.
_NOT_KERNELS = frozenset({"aten.empty.memory_format", "aten.empty_strided.default",
                          "profiler._record_function_enter_new.default",
                          "profiler._record_function_exit._RecordFunction"})


class KernelOps(TorchDispatchMode):
    """Counts the ops dispatched inside it that may launch a kernel on a GPU (``kernels``, by op overload; a host
    read such as ``_local_scalar_dense`` counts too), with views and aliasing ops (``views``: metadata only) and
    allocations and profiler markers (``others``) apart. Thread-safe: it may be entered on a worker thread too
    (the offloaded optimizer's host step).

    Example:
        >>> with KernelOps() as ops:
        ...     _ = torch.ones(4).add_(1)
        >>> ops.total
        2
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.views = self.others = 0
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with self._lock:
            if func.is_view:
                self.views += 1
            elif str(func) in _NOT_KERNELS:
                self.others += 1
            else:
                self.kernels[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.kernels.values())


