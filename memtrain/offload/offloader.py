"""Activation offload: the tensors autograd saves for backward wait in host memory instead of on the device.

Each offloaded byte crosses PCIe twice (device -> host in forward, host -> device in backward) and nothing is
recomputed: device memory for bandwidth. The copies run on a side stream so they hide behind compute when
there is enough compute per byte (a checkpointed block's input: 64 MB per layer on the 1.1B Llama shape with
its fp32 residual stream, about a millisecond at 55 GB/s against several of compute), and they cannot hide
when there is not (every activation of an uncheckpointed transformer: far more bytes than PCIe moves in the
time the GPU computes them).

How it works (``ActivationOffloader``, built on ``torch.autograd.graph.saved_tensors_hooks``):

- forward: a saved tensor whose storage is at least ``min_bytes`` is copied, whole storage at once, into a
  block of a pinned host pool (fixed-size slabs under a host-RAM budget, reused every step); views and
  tensors saved twice share one copy. Parameters (frozen ones too), buffers, casts of parameters (autocast's
  weight copies) and everything saved once the model's head has started (logits and the loss) stay on the device;
- backward: tensors come back in reverse order of saving (after the first step: in the order backward really
  used them, recorded then), ``prefetch_depth`` tensors ahead of use; a callback at the end of backward drops
  whatever is still restored, so the optimizer step runs without it;
- safety: every copy is on one side stream. The side stream waits for the compute stream before reading a
  tensor; the device tensor is kept until its copy is done (or the compute stream waits on the copy's event).
  A restored tensor is allocated on the compute stream (FSDP2's pattern: the allocator reuses it in that stream's
  order, no ``record_stream``, so reserved memory does not grow while the host runs ahead); the side stream waits
  for an event recorded there before copying into it, and the compute stream waits for the copy's event before
  using it, or before freeing it unused. Host blocks are only ever touched by copies on that one stream, so
  stream order alone makes their reuse safe.

The device-specific operations sit behind a small ``Transport`` over the device seam (``CpuTransport`` runs the
same logic on the plain CPU with plain copies, for tests and dry runs). Its synchronisation is tested on a CPU-only
machine twice: whole, on the simulated accelerator (tests/test_offload_simulated.py), and step by step over a model
of two streams that fails on each missing wait (tests/offload_stream_model.py).
"""

from __future__ import annotations

import collections
import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from memtrain.device import accelerator, default_device
from memtrain.errors import ConfigError, MemtrainError
from memtrain.measure import available_host_bytes
from memtrain.message import Message, arg
from memtrain.offload.host_pool import SLAB_BYTES_DEFAULT, HostPool
from memtrain.offload.saved import Handle, OffloadStats, Record, derived_from_leaf, find_output_head
from memtrain.offload.transport import Transport, device_exists, warn_noop
from memtrain.report import format_bytes

MIN_BYTES_DEFAULT = 2**20  # below this a copy costs more in launch overhead than it frees


# -- the offloader ------------------------------------------------------------------------------------------
class ActivationOffloader:
    """The context ``offload_activations`` returns: build it once, enter it every step (pool and order persist).

    Disabled (a transparent no-op) when ``transport`` is None. Re-entrant: the same offloader may be entered by
    each checkpointed block and share one pool and one recorded order for the whole model. A model holding one
    pickles (``torch.save(model)``): the offloader is saved as its settings and built fresh where it is loaded;
    ``copy.deepcopy`` shares it.
    """

    def __init__(self, transport: Transport | None, *, model: nn.Module | None = None,
                 head: nn.Module | None = None, include_logits: bool = False, min_bytes: int = MIN_BYTES_DEFAULT,
                 host_budget_bytes: int | None = None, prefetch_depth: int = 2, slab_bytes: int | None = None):
        problems = []
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 1:
            problems.append(f"min_bytes={min_bytes!r}: it must be an integer >= 1 (bytes). To resolve this error, "
                            f"pass e.g. min_bytes={MIN_BYTES_DEFAULT} (1 MiB).")
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
            problems.append(f"prefetch_depth={prefetch_depth!r}: it must be an integer >= 1. To resolve this "
                            "error, pass prefetch_depth=2 (two tensors fetched ahead of backward).")
        if host_budget_bytes is not None and (isinstance(host_budget_bytes, bool) or not isinstance(
                host_budget_bytes, int) or host_budget_bytes <= 0):
            problems.append(f"host_budget_bytes={host_budget_bytes!r}: it must be a positive integer (bytes). To "
                            "resolve this error, pass e.g. parse_bytes('16GiB'), or None for half the free RAM.")
        if model is not None and not isinstance(model, nn.Module):
            problems.append(f"model={type(model).__name__}: it must be an nn.Module. To resolve this error, pass "
                            "the model being trained.")
        if head is not None and not isinstance(head, nn.Module):
            problems.append(f"head={type(head).__name__}: it must be an nn.Module (the output layer). To resolve "
                            "this error, pass e.g. head=model.lm_head.")
        ConfigError.raise_if(problems)
        head = None if include_logits else (head or (find_output_head(model) if model is not None else None))
        self._start(transport, model=model, head=head, min_bytes=min_bytes, host_budget_bytes=host_budget_bytes,
                    prefetch_depth=prefetch_depth, slab_bytes=slab_bytes)

    def _start(self, transport: Transport | None, *, model: nn.Module | None, head: nn.Module | None,
               min_bytes: int, host_budget_bytes: int | None, prefetch_depth: int, slab_bytes: int | None) -> None:
        """Builds the runtime state from settings already checked (``head`` already found, or None)."""
        # What pickling keeps: the settings as given (a default budget is half the free RAM where it is loaded).
        self._settings = dict(model=model, head=head, min_bytes=min_bytes, host_budget_bytes=host_budget_bytes,
                              prefetch_depth=prefetch_depth, slab_bytes=slab_bytes)
        self.transport = transport
        self.model = model
        self.head = head
        self.min_bytes = min_bytes
        self.prefetch_depth = prefetch_depth
        self.device = transport.device if transport is not None else None
        self.pool: HostPool | None = None
        if transport is not None:
            free = available_host_bytes()
            free = 2**62 if free is None else free  # the machine does not say: do not refuse
            if host_budget_bytes is None:
                host_budget_bytes = free // 2
            elif host_budget_bytes > free:
                raise MemtrainError(
                    f"{arg('offload_activations')}: host_budget_bytes={format_bytes(host_budget_bytes)} is more than the "
                    f"{format_bytes(free)} of host memory available now; pinning it would starve the machine. "
                    f"To resolve this error, pass host_budget_bytes <= {format_bytes(free)} (e.g. half of it)."
                )
            if slab_bytes is None:
                # A power of two: torch's pinned-memory allocator rounds every request up to one, so the budget
                # then counts what is really pinned.
                slab_bytes = min(SLAB_BYTES_DEFAULT, 1 << (host_budget_bytes.bit_length() - 1))
            self.pool = HostPool(transport, budget_bytes=host_budget_bytes, slab_bytes=slab_bytes)

        self._lock = threading.RLock()
        self._dead: collections.deque[tuple[Record, int]] = collections.deque()
        self._hooks: list[Any] = []
        self._module_hooks: list[Any] = []
        self._state_keys: set[int] = set()  # storages of the tracked modules' parameters and buffers
        self._frozen_shapes: set[tuple[int, ...]] = set()  # shapes of their frozen floating-point parameters
        self._state_epoch = -1  # the step the two sets above were gathered for
        self._tracked: list[weakref.ref[nn.Module]] = []
        if model is not None:
            self.track_state(model)
        self._in_tail = False
        self._epoch_id = 0
        self._epoch: list[Record] = []  # this step's records, in the order they were saved
        self._epoch_live = 0  # records of this step not yet released
        self._observed: list[int] = []  # record indices in the order backward first used them
        self._observed_set: set[int] = set()
        self._unpacked_since_pack = False
        self._plan: list[Record] | None = None
        self._plan_pos: dict[int, int] = {}
        self._learned: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._by_storage: dict[int, tuple[StorageWeakRef, Record, int]] = {}
        self._inflight: collections.deque[Record] = collections.deque()
        self._finished: collections.deque[Record] = collections.deque()
        self._warned_budget = False
        self._end_queued_for = -1  # the backward (graph task) whose end will release what is still restored
        self._counts: collections.Counter[str] = collections.Counter()
        self._kept: collections.Counter[str] = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.transport is not None

    def __repr__(self) -> str:
        if not self.enabled:
            return "ActivationOffloader(disabled: no accelerator)"
        return (f"ActivationOffloader(device={self.device}, min_bytes={self.min_bytes}, prefetch_depth="
                f"{self.prefetch_depth}, host_budget={format_bytes(self.pool.capacity_bytes)})")

    # -- context ----------------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> ActivationOffloader:
        # A copied model (e.g. estimate's meta copy) shares the offloader: it is a runtime resource (a pinned pool,
        # a side stream), not state of the model.
        return self

    def __getstate__(self) -> dict[str, Any]:
        # torch.save(model) / pickle: a lock, a stream, pinned slabs and this step's records cannot (and need not)
        # be saved. The settings are; the transport pickles as a fresh one (or None where its device is missing).
        tracked = [m for m in (ref() for ref in self._tracked) if m is not None]
        return {"transport": self.transport, "tracked": tracked, **self._settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        tracked = state.pop("tracked", [])
        self._start(state.pop("transport"), **state)
        for module in tracked:
            self.track_state(module)

    def track_state(self, module: nn.Module) -> None:
        """Keeps the parameters and buffers of ``module`` on the device, with views and copies of its frozen
        parameters (autocast's casts: made afresh at every use, they have no autograd history to trace).

        ``model=`` is tracked already; ``apply_checkpointing`` tracks the model whose blocks share the offloader.
        """
        if not any(ref() is module for ref in self._tracked):
            self._tracked.append(weakref.ref(module))
            self._state_epoch = -1

    def _gather_state(self) -> None:
        # Once a step, not at every (per-block) enter: parameters may be replaced between steps (model.to(...)),
        # and frozen ones may be unfrozen.
        modules = [m for m in (ref() for ref in self._tracked) if m is not None]
        params = [p for m in modules for p in m.parameters()]
        self._state_keys = {t.untyped_storage()._cdata for t in (*params, *(b for m in modules for b in m.buffers()))}
        self._frozen_shapes = {tuple(p.shape) for p in params if not p.requires_grad and p.is_floating_point()}
        self._state_epoch = self._epoch_id

    def __enter__(self) -> ActivationOffloader:
        if not self.enabled:
            return self
        if not self._hooks:
            self._in_tail = False
            if self.model is not None:
                self._module_hooks.append(self.model.register_forward_pre_hook(self._leave_tail))
            if self.head is not None:
                self._module_hooks.append(self.head.register_forward_pre_hook(self._enter_tail))
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self._hooks.pop().__exit__(*exc)
        if not self._hooks:
            for h in self._module_hooks:
                h.remove()
            self._module_hooks.clear()
            self._in_tail = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run inside this context: e.g. a checkpointed block call, whose saved inputs then move out."""
        if not self.enabled:
            return fn

        @functools.wraps(fn)
        def offloaded(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return offloaded

    def _enter_tail(self, module: nn.Module, args: Any) -> None:
        self._in_tail = True

    def _leave_tail(self, module: nn.Module, args: Any) -> None:
        self._in_tail = False

    # -- forward: pack ----------------------------------------------------------------------------------
    def _keep_reason(self, t: torch.Tensor) -> str | None:
        if type(t) not in (torch.Tensor, nn.Parameter):
            return "tensor subclass"
        if t.device != self.device:
            return "other device"
        if t.layout != torch.strided or t.is_conj() or t.is_neg():
            return "layout"
        storage = t.untyped_storage()
        if storage.nbytes() < self.min_bytes:
            return "small"
        if isinstance(t, nn.Parameter) or storage._cdata in self._state_keys:
            return "parameter"
        base = t if t._base is None else t._base
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad) or derived_from_leaf(t):
            return "parameter"
        if (base.grad_fn is None and not base.requires_grad and base.is_floating_point()
                and tuple(base.shape) in self._frozen_shapes):
            # NOTE: a cast of a frozen weight is a fresh tensor with no history; its shape is all that tells it
            # apart. An activation of no history (before any trainable weight) with a frozen weight's shape stays
            # too: a copy saved, never a wrong gradient.
            return "copy of a frozen parameter"
        if self._in_tail:
            return "logits"
        return None

    def _pack(self, t: torch.Tensor) -> Any:
        with self._lock:
            self._drain()
            if self._unpacked_since_pack or (self._epoch and self._epoch_live == 0):
                # A forward after a backward, or after a graph dropped without one: a new step begins.
                self._new_epoch()
            if self._state_epoch != self._epoch_id:
                self._gather_state()
            reason = self._keep_reason(t)
            if reason is not None:
                self._kept[reason] += 1
                return t
            storage = t.untyped_storage()
            entry = self._by_storage.get(storage._cdata)
            # NOTE: the version check keeps a storage modified in place between two saves from sharing a copy.
            if entry is not None and not entry[0].expired() and entry[2] == t._version and not entry[1].released:
                record = entry[1]
                self._counts["deduplicated"] += 1
            else:
                record = self._offload(t, storage)
                if record is None:
                    return t
                self._by_storage[storage._cdata] = (StorageWeakRef(storage), record, t._version)
            record.handles += 1
            self._counts["offloaded_tensors"] += 1
            return Handle(record, t, self._dead)

    def _offload(self, t: torch.Tensor, storage: torch.UntypedStorage) -> Record | None:
        nbytes = storage.nbytes()
        pool = self.pool
        extent = pool.alloc(nbytes)
        if extent is None:
            # Kept on the device, as if it were not worth a copy: the step still runs, with more device memory.
            self._counts["over_budget_bytes"] += nbytes
            self._kept["pinning failed" if pool.pin_error else "host budget"] += 1
            if not self._warned_budget:
                self._warned_budget = True
                if pool.pin_error:
                    message = (f"{arg('offload_activations')} could not pin {format_bytes(pool.slab_bytes)} more host "
                               f"memory ({pool.pin_error}); it keeps using the {format_bytes(pool.reserved_bytes)} "
                               "pinned so far, and tensors that do not fit stay on the device "
                               "(OffloadStats.over_budget_bytes counts them). Hint: free host memory, or pass "
                               "a smaller host_budget_bytes.")
                else:
                    message = (f"{arg('offload_activations')}: the host budget of {format_bytes(pool.capacity_bytes)} is "
                               f"full ({format_bytes(pool.used_bytes)} in use); tensors that do not fit stay on "
                               "the device (OffloadStats.over_budget_bytes counts them). Hint: raise "
                               "host_budget_bytes, or checkpoint more blocks.")
                warnings.warn(Message(message), stacklevel=4)
            return None
        record = Record(self._epoch_id, len(self._epoch), nbytes, extent)
        record.src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        record.d2h_event = self.transport.copy_to_host(record.src, self.pool.segments(extent), record.index)
        self._counts["offloaded_bytes"] += nbytes
        self._epoch.append(record)
        self._epoch_live += 1
        self._inflight.append(record)
        self._retire_copies()
        return record

    def _retire_copies(self) -> None:
        # Device memory is freed once its copy is done. Beyond prefetch_depth copies in flight the compute
        # stream waits for the oldest (on the GPU, not the host): device memory stays bounded when the copies
        # cannot keep up with compute.
        while self._inflight:
            record = self._inflight[0]
            if record.src is not None:
                if self.transport.query(record.d2h_event):
                    record.src = None
                elif len(self._inflight) > self.prefetch_depth:
                    self._release_src(record)
                else:
                    return
            self._inflight.popleft()

    def _release_src(self, record: Record) -> None:
        # The side stream may still be reading src: the compute stream, which reuses freed memory, waits first.
        if not self.transport.query(record.d2h_event):
            self.transport.wait(record.d2h_event)
        record.src = None

    # -- backward: unpack -------------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return packed
        with self._lock:
            self._drain()
            self._unpacked_since_pack = True
            self._release_at_end_of_backward()
            record = packed.record
            current = record.epoch == self._epoch_id
            if current and self._plan is None:
                self._make_plan()
            if current and record.index not in self._observed_set:
                self._observed_set.add(record.index)
                self._observed.append(record.index)
            base = self._resident(record)
            out = torch.empty(0, dtype=packed.dtype, device=base.device).set_(
                base.untyped_storage(), packed.offset, packed.size, packed.stride)
            if packed.unpacked_pass != record.passes:  # a node may read its saved tensors more than once
                packed.unpacked_pass = record.passes
                record.unpacked += 1
            if record.unpacked >= record.handles:
                self._finish_pass(record)
            if current:
                self._prefetch_after(record)
            return out

    def _release_at_end_of_backward(self) -> None:
        # Nothing calls the offloader between backward and the optimizer step: without a callback at the end of
        # backward, the last records' device copies (and sources still copying) would stay through the step.
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._end_queued_for:
            self._end_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Backward is over: released records free their host blocks; the others (``retain_graph``) keep only
        their host copy, fetched again if another backward needs it."""
        with self._lock:
            self._drain()
            for record in (*self._epoch, *self._finished, *self._inflight):
                self._drop_data(record)
                record.done = False  # another backward of this graph (retain_graph) wants it prefetched again
                if record.src is not None:
                    self._release_src(record)
            self._finished.clear()
            self._retire_copies()

    def _finish_pass(self, record: Record) -> None:
        """Every live saved tensor of this storage is out: autograd holds what it still needs."""
        record.passes += 1
        record.unpacked = 0
        record.done = True
        # Normally the handles die right after their node ran and the record is released with them. Until then
        # the device copy stays for a little while, as a node may read its saved tensors twice (custom
        # Functions do); with retain_graph the handles never die, and the window bounds device memory.
        self._finished.append(record)
        while len(self._finished) > self.prefetch_depth:
            old = self._finished.popleft()
            if old not in self._finished:
                self._drop_data(old)
                if old.src is not None:
                    self._release_src(old)

    def _resident(self, record: Record) -> torch.Tensor:
        if record.src is not None:
            if record.unpacked == 0 and record.passes == 0:
                self._counts["served_from_device"] += 1
            return record.src
        if record.data is None:
            self._fetch(record)
            self._counts["fetched_on_demand"] += 1
        self._wait_data(record)
        return record.data

    def _wait_data(self, record: Record) -> None:
        # The compute stream (not the host) waits for the copy once; the event is dropped after.
        self.transport.wait(record.h2d_event)
        record.h2d_event = None

    def _drop_data(self, record: Record) -> None:
        """Frees the restored device bytes. Allocated on the compute stream, they are reused in its order at once:
        a prefetch never used may still be copying into them, so the compute stream waits for it first."""
        if record.data is not None:
            self._wait_data(record)
        record.data = None

    def _fetch(self, record: Record) -> None:
        record.data, record.h2d_event = self.transport.copy_to_device(
            self.pool.segments(record.extent), record.nbytes, record.index)

    def _make_plan(self) -> None:
        signature = tuple(r.nbytes for r in self._epoch)
        if self._learned is not None and self._learned[0] == signature:
            order: Any = self._learned[1]
            self._counts["learned_order_used"] += 1
        else:
            order = range(len(self._epoch) - 1, -1, -1)
        self._plan = [self._epoch[i] for i in order]
        self._plan_pos = {id(r): pos for pos, r in enumerate(self._plan)}

    def _prefetch_after(self, record: Record) -> None:
        pos = self._plan_pos.get(id(record))
        if pos is None:
            return
        for ahead in self._plan[pos + 1:pos + 1 + self.prefetch_depth]:
            if ahead.released or ahead.done or ahead.src is not None or ahead.data is not None:
                continue
            self._fetch(ahead)
            self._counts["prefetched"] += 1

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _new_epoch(self) -> None:
        """A forward after a backward: keep the order the last backward used, start a fresh record list."""
        if self._observed:
            seen = set(self._observed)
            order = self._observed + [i for i in range(len(self._epoch) - 1, -1, -1) if i not in seen]
            self._learned = (tuple(r.nbytes for r in self._epoch), tuple(order))
        self._epoch_id += 1
        self._epoch_live = 0
        self._epoch, self._observed, self._observed_set, self._plan, self._plan_pos = [], [], set(), None, {}
        self._by_storage.clear()
        self._unpacked_since_pack = False

    def _drain(self) -> None:
        while self._dead:
            record, unpacked_pass = self._dead.popleft()
            record.handles -= 1
            if unpacked_pass == record.passes:
                record.unpacked -= 1
            if record.handles == 0 and not record.released:
                record.released = True
                self._epoch_live -= record.epoch == self._epoch_id
                self._drop_data(record)
                if record.src is not None:
                    self._release_src(record)
                self.pool.free(record.extent)
            elif 0 < record.handles <= record.unpacked:
                self._finish_pass(record)

    def stats(self) -> OffloadStats:
        """A snapshot of the counters (see ``OffloadStats``)."""
        with self._lock:
            if self.enabled:
                self._drain()
            pool = self.pool
            return OffloadStats(
                offloaded_tensors=self._counts["offloaded_tensors"],
                offloaded_bytes=self._counts["offloaded_bytes"],
                deduplicated=self._counts["deduplicated"],
                kept=tuple(sorted(self._kept.items())),
                over_budget_bytes=self._counts["over_budget_bytes"],
                prefetched=self._counts["prefetched"],
                fetched_on_demand=self._counts["fetched_on_demand"],
                served_from_device=self._counts["served_from_device"],
                learned_order_used=self._counts["learned_order_used"],
                host_reserved_bytes=pool.reserved_bytes if pool else 0,
                host_used_bytes=pool.used_bytes if pool else 0,
                host_peak_used_bytes=pool.peak_used_bytes if pool else 0,
            )


# -- public API ---------------------------------------------------------------------------------------------
def offload_activations(
    *,
    model: nn.Module | None = None,
    head: nn.Module | None = None,
    include_logits: bool = False,
    min_bytes: int = MIN_BYTES_DEFAULT,
    host_budget_bytes: int | None = None,
    prefetch_depth: int = 2,
    device: str | torch.device | None = None,
) -> ActivationOffloader:
    """Keeps the tensors saved for backward in pinned host memory: device memory for PCIe traffic, no recompute.

    Each offloaded byte crosses PCIe twice. With checkpointing only the block inputs are saved, and their
    copies hide behind compute (``apply_checkpointing(model, offload=True)``); offloading every activation of
    an uncheckpointed transformer is bandwidth-bound and slows the step down. Build the context once and enter
    it every step: the pinned pool and the recorded backward order persist in it.

    What stays on the device: tensors whose storage is under ``min_bytes``; parameters (frozen ones too: LoRA's
    base weights), buffers, views and casts of them (autocast's weight copies); and everything saved once ``head`` has started its forward (the
    logits, the loss's fp32 softmax): backward needs those first, so moving them out and back would only add
    traffic. ``head`` defaults to the model's output layer (Hugging Face ``get_output_embeddings()``, else a
    child named ``lm_head``/``head``/``output``); ``include_logits=True`` offloads them too.

    NOTE: with hooks, autograd no longer detects a saved tensor modified in place; plain PyTorch raises there,
    and with offloading the value backward sees is undefined. Do not modify saved tensors in place.

    Args:
        model: the model being trained, when the context wraps its whole forward: its buffers and the copies of
            its frozen parameters are never offloaded (parameters never are in any case), its head is found, and
            its device is the default ``device``. Leave it out for a context entered per block (``wrap``), and
            call ``track_state(model)`` instead (``apply_checkpointing`` does).
        head: the module whose start marks the tail of the forward kept on the device (default: found in
            ``model``); ignored when ``include_logits``.
        include_logits: offload the tail too.
        min_bytes: smallest storage (bytes) worth a copy; default 1 MiB.
        host_budget_bytes: most pinned host memory to use (bytes); default half the RAM available now. Checked
            against the available RAM before anything is allocated. Tensors that do not fit stay on the device,
            with one warning; so do they when pinning more host memory fails mid-run.
        prefetch_depth: copies in flight each way: saved tensors fetched ahead of backward, and copies to the
            host outstanding before the compute stream waits for the oldest.
        device: the device whose tensors move (default: the model's device, else ``memtrain.device.default_device()``);
            any device the seam gives streams (CUDA, ROCm, XPU, the simulated accelerator).

    Returns:
        An ``ActivationOffloader`` (a reusable, re-entrant context manager with ``.stats()``). Without an accelerator it is
        a transparent no-op, and says so once per process.

    Raises:
        ConfigError: a bad argument, or ``device`` naming a device that is not available.
        MemtrainError: ``host_budget_bytes`` larger than the host memory available.

    Example:
        >>> model = torch.nn.Linear(8, 8)
        >>> offload = offload_activations(model=model)  # doctest: +SKIP
        >>> with offload:  # doctest: +SKIP
        ...     loss = model(torch.randn(4, 8)).sum()
        >>> loss.backward()  # doctest: +SKIP
    """
    if device is None and isinstance(model, nn.Module):
        device = next((p.device for p in model.parameters()), None)
    try:
        device = default_device() if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a device. To resolve this error, pass e.g. device='cuda:0', "
                          "or None for the model's device.") from None
    if not device_exists(device):
        raise ConfigError(f"offload_activations(device={str(device)!r}): {device.type.upper()} is not available on "
                          "this machine. To resolve this error, pass device=None (a no-op without an accelerator).")
    acc = accelerator(device)
    transport: Transport | None = None
    if acc.has_streams:
        transport = Transport(acc)
    elif device.type == "cpu":
        warn_noop("no accelerator")
    else:
        raise ConfigError(f"offload_activations(device={str(device)!r}): only devices with streams (CUDA, ROCm, "
                          "XPU) are supported. To resolve this error, train on one, or drop activation offload.")
    return ActivationOffloader(transport, model=model, head=head, include_logits=include_logits,
                               min_bytes=min_bytes, host_budget_bytes=host_budget_bytes,
                               prefetch_depth=prefetch_depth)
