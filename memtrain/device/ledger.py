"""The simulated device's memory: which CPU storages are "on the device", counted with the caching allocator's
rules, and the pinned host memory, counted with the host allocator's.

A storage is on the device when the seam placed or allocated it there, or when an op on the loop's thread made it
from device inputs (or from none, inside ``compute()``, e.g. a mask built in forward); everything else is host
memory. Like torch's caching allocator: each storage takes a multiple of 512 bytes; a freed storage with a use
recorded on another stream (``record_stream``) stays reserved until that stream passed the use. Reserved bytes are
the allocated ones and those blocks; with ``segments``, the caching allocator's segments holding them
(``memtrain.device.segments``: 2 MiB and 20 MiB segments, or expandable ones where ``PYTORCH_CUDA_ALLOC_CONF`` asks
for them, as torch reads it). An allocation that would not fit the capacity first synchronizes, frees such blocks
and gives the free segments back (``num_alloc_retries``), then raises ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memtrain.device.allocator import expandable_segments
from memtrain.device.segments import SegmentModel

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


class _Blocks:
    """Reserved bytes without segments: every block's own (512-byte) size, reused at once (``SegmentModel``'s
    interface)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.reserved = self.peak_reserved = 0

    def malloc(self, key: int, nbytes: int) -> None:
        self.live[key] = round_up(nbytes, BLOCK)
        self.reserved += self.live[key]
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key: int) -> None:
        self.reserved -= self.live.pop(key, 0)

    def growth(self, nbytes: int) -> int:
        return round_up(nbytes, BLOCK)

    def release(self) -> None:
        return None


class DeviceLedger:
    """Device bytes: live storages, blocks held by a recorded use, peaks, the capacity."""

    def __init__(self, capacity: int, *, synchronize: Callable[[], None], segments: bool = False):
        self.capacity = capacity
        self._synchronize = synchronize
        self.lock = threading.RLock()
        self.live: dict[int, int] = {}  # storage key -> bytes (rounded)
        self._refs: dict[int, weakref.ref] = {}
        self.uses: dict[int, list[Any]] = {}  # storage key -> the streams recorded as using it
        self.written: dict[int, int] = {}  # storage key -> compute clock of its last write (race checks)
        self.read: dict[int, int] = {}  # storage key -> compute clock of its last read by compute
        self.held: list[tuple[int, list[tuple[Any, int]]]] = []  # freed blocks (their ids) waiting for recorded uses
        self.allocated = self.peak_allocated = 0
        self.segments = SegmentModel(expandable=expandable_segments()) if segments else _Blocks()
        self.blocks: dict[int, int] = {}  # storage key -> its block's id in the segments (keys are reused, ids not)
        self._blocks = 0
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
            self._grow(key, nbytes)

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
                self._grow(key, new)

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
        block = self.blocks.pop(key, None)
        if block is None:
            return
        # As the caching allocator does: an event on each recorded stream at the free, the block reusable once
        # every one completed.
        pending = [(s, s.position) for s in self.uses.pop(key, []) if not s.passed(s.position)]
        if pending:
            self.held.append((block, pending))
        else:
            self.segments.free(block)

    def _grow(self, key: int, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        if nbytes:  # a storage of no bytes takes no block
            self._blocks += 1
            self.blocks[key] = self._blocks
            self.segments.malloc(self._blocks, nbytes)

    @property
    def reserved(self) -> int:
        self._free_passed()
        return self.segments.reserved

    @property
    def peak_reserved(self) -> int:
        return self.segments.peak_reserved

    def _free_passed(self, everything: bool = False) -> None:
        """Frees the held blocks whose recorded uses the streams passed (``everything``: after a synchronize)."""
        keep = []
        for block, uses in self.held:
            if everything or all(s.passed(p) for s, p in uses):
                self.segments.free(block)
            else:
                keep.append((block, uses))
        self.held = keep

    def _make_room(self, nbytes: int) -> None:
        self._free_passed()
        if self.segments.reserved + self.segments.growth(nbytes) <= self.capacity:
            return
        # The caching allocator's retry: synchronize, free the blocks the streams passed, give the free segments
        # back to the driver (a retry where that freed anything).
        before, held = self.segments.reserved, bool(self.held)
        if held:
            self._synchronize()
            self._free_passed(everything=True)
        self.segments.release()
        self.retries += held or self.segments.reserved < before
        if self.segments.reserved + self.segments.growth(nbytes) > self.capacity:
            self.ooms += 1
            mib = 2**20
            raise torch.OutOfMemoryError(
                f"simulated device out of memory. Tried to allocate {nbytes / mib:.2f} MiB with "
                f"{self.allocated / mib:.2f} MiB allocated and {self.segments.reserved / mib:.2f} MiB reserved (the "
                f"caching allocator's segments) of {self.capacity / mib:.2f} MiB. To resolve this error, "
                "plan for that capacity (memtrain train --budget) or simulate a larger device "
                "(MEMTRAIN_SIMULATED_DEVICE).")

    def reset_peaks(self) -> None:
        with self.lock:
            self.peak_allocated = self.allocated
            self.segments.peak_reserved = self.reserved

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
