"""The simulated device's memory: which CPU storages are "on the device", counted with the caching allocator's
rules, and the pinned host memory, counted with the host allocator's.

A storage is on the device when the seam placed or allocated it there, or when an op on the loop's thread made it
from device inputs (or from none, inside ``compute()``, e.g. a mask built in forward); everything else is host
memory. Like torch's caching allocator: each storage takes a multiple of 512 bytes; a freed storage with a use
recorded on another stream (``record_stream``) stays reserved until that stream passed the use; an allocation that
does not fit first synchronizes and frees such blocks (``num_alloc_retries``), then raises
``torch.OutOfMemoryError``. Reserved bytes are the allocated ones plus those blocks (a free block is reused at
once: no fragmentation is modelled).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

BLOCK = 512  # the CUDA caching allocator's rounding
_ITEM = torch.ops.aten._local_scalar_dense.default  # .item(): the host reads a device value (waits for compute)


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length() if n > 0 else 0


_VIEWS: dict[Any, bool] = {}


def _is_view(func: Any) -> bool:
    view = _VIEWS.get(func)
    if view is None:
        schema = func._schema
        view = _VIEWS[func] = bool(schema.returns) and not schema.is_mutable and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    return view


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class DeviceLedger:
    """Device bytes: live storages, blocks held by a recorded use, peaks, the capacity."""

    def __init__(self, capacity: int, *, synchronize: Callable[[], None]):
        self.capacity = capacity
        self._synchronize = synchronize
        self.lock = threading.RLock()
        self.live: dict[int, int] = {}  # storage key -> bytes (rounded)
        self._refs: dict[int, weakref.ref] = {}
        self.uses: dict[int, list[Any]] = {}  # storage key -> the streams recorded as using it
        self.written: dict[int, int] = {}  # storage key -> compute clock of its last write (race checks)
        self.read: dict[int, int] = {}  # storage key -> compute clock of its last read by compute
        self.held: list[tuple[int, list[tuple[Any, int]]]] = []  # freed blocks waiting for recorded uses
        self.allocated = self.peak_allocated = 0
        self.peak_reserved = 0
        self.retries = self.ooms = 0

    # -- counting ---------------------------------------------------------------------------------------------
    def is_device(self, t: torch.Tensor) -> bool:
        return _key(t) in self.live

    def add(self, t: torch.Tensor) -> None:
        """Counts ``t``'s storage as device memory (raises torch.OutOfMemoryError where it does not fit)."""
        storage = t.untyped_storage()
        key = storage._cdata
        with self.lock:
            if key in self.live:
                return
            nbytes = round_up(storage.nbytes(), BLOCK)
            self._make_room(nbytes)
            self.live[key] = nbytes
            self._refs[key] = weakref.ref(storage, lambda _r, key=key: self._free(key))
            self._grow(nbytes)

    def resized(self, t: torch.Tensor, old_nbytes: int) -> None:
        """``t``'s storage changed size (``resize_``): a resize to 0 frees its block, a resize up allocates one."""
        key = _key(t)
        with self.lock:
            if key not in self.live:
                return
            new = round_up(t.untyped_storage().nbytes(), BLOCK)
            if new == self.live[key]:
                return
            self._release(key, self.live[key])
            self.live[key] = 0
            if new:
                self._make_room(new)
                self.live[key] = new
                self._grow(new)

    def record_use(self, t: torch.Tensor, stream: Any) -> None:
        with self.lock:
            key = _key(t)
            if key in self.live:
                self.uses.setdefault(key, []).append(stream)

    def _free(self, key: int) -> None:
        with self.lock:
            nbytes = self.live.pop(key, 0)
            self._refs.pop(key, None)
            self.written.pop(key, None)
            self.read.pop(key, None)
            self._release(key, nbytes)
            self.uses.pop(key, None)

    def _release(self, key: int, nbytes: int) -> None:
        self.allocated -= nbytes
        # As the caching allocator does: an event on each recorded stream at the free, the block reusable once
        # every one completed.
        pending = [(s, s.position) for s in self.uses.pop(key, []) if not s.passed(s.position)]
        if pending and nbytes:
            self.held.append((nbytes, pending))

    def _grow(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    @property
    def reserved(self) -> int:
        self.held = [(n, uses) for n, uses in self.held if not all(s.passed(p) for s, p in uses)]
        return self.allocated + sum(n for n, _ in self.held)

    def _make_room(self, nbytes: int) -> None:
        if self.reserved + nbytes <= self.capacity:
            return
        if self.held:  # the caching allocator's retry: synchronize, free the blocks the streams passed
            self.retries += 1
            self._synchronize()
            self.held = []
        if self.allocated + nbytes > self.capacity:
            self.ooms += 1
            mib = 2**20
            raise torch.OutOfMemoryError(
                f"simulated device out of memory. Tried to allocate {nbytes / mib:.2f} MiB with "
                f"{self.allocated / mib:.2f} MiB allocated of {self.capacity / mib:.2f} MiB. To resolve this error, "
                "plan for that capacity (memtrain train --budget) or simulate a larger device "
                "(MEMTRAIN_SIMULATED_DEVICE).")

    def reset_peaks(self) -> None:
        with self.lock:
            self.peak_allocated = self.allocated
            self.peak_reserved = self.reserved

    def stats(self) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.peak_allocated,
                "reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.peak_reserved,
                "num_alloc_retries": self.retries, "num_ooms": self.ooms}


class HostLedger:
    """Pinned host bytes: torch's host allocator rounds each request up to a power of two; a registered buffer
    takes its exact size. Over ``capacity`` (when given) the allocation fails as a refused pinning does."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self.lock = threading.Lock()
        self.current = self.peak = 0

    def add(self, t: torch.Tensor, *, rounded: bool) -> None:
        nbytes = t.untyped_storage().nbytes()
        nbytes = next_power_of_two(nbytes) if rounded else nbytes
        with self.lock:
            if self.capacity is not None and self.current + nbytes > self.capacity:
                # A RuntimeError, as a refused pinning is in torch.
                raise RuntimeError(f"simulated pinned host memory exhausted: {nbytes} more bytes over "
                                   f"{self.current} of {self.capacity}. To resolve this error, pin less or pass a "
                                   "larger host_capacity to simulate().")
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        weakref.finalize(t.untyped_storage(), self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        with self.lock:
            self.current -= nbytes


class LedgerMode(TorchDispatchMode):
    """Sees every op of the thread that entered the simulation; one on device data (or a factory inside
    ``compute()``) runs on the compute stream: it ticks the compute clock, its outputs are device memory, and it
    stamps what it read and wrote (for the side streams' race checks)."""

    def __init__(self, sim: Any):
        super().__init__()
        self.sim = sim
        self.compute_depth = 0
        self.host_depth = 0
        self.clock = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.device.type != "cpu" for t in inputs):  # fake or meta tensors (the estimator's): not ours
            return out
        ledger = self.sim.ledger
        if self.host_depth:
            return out
        on_device = [t for t in inputs if ledger.is_device(t)]
        if not (on_device or (not inputs and self.compute_depth > 0)):
            return out  # host work: not on the compute stream
        if _is_view(func):
            return out  # metadata: no kernel reads or writes anything
        self.clock += 1
        if func is _ITEM:  # the host reads a device value: it waits for everything queued on compute
            self.sim.host_waited_compute()
            return out
        schema = func._schema
        for t in on_device:  # what compute read, for the side streams' write-after-read check
            ledger.read[_key(t)] = self.clock
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            aliased = i < len(schema.returns) and schema.returns[i].alias_info is not None
            for u in (t if isinstance(t, (tuple, list)) else (t,)):
                if isinstance(u, torch.Tensor) and u.device.type == "cpu" and not aliased:  # a view writes nothing
                    ledger.add(u)
                    ledger.written[_key(u)] = self.clock
        for arg, value in zip(schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for u in (value if isinstance(value, (tuple, list)) else (value,)):
                    if isinstance(u, torch.Tensor) and ledger.is_device(u):
                        ledger.written[_key(u)] = self.clock
        return out
