"""A simulated accelerator: CUDA's stream, event and allocator semantics over CPU tensors, so that every CUDA path of
memtrain runs (and fails where it would fail on a GPU) in ``make test``.

What it models:

- side streams run behind the host: a copy queued on one holds its destination poisoned (NaN; all bits set for
  integers) until an event recorded after it is waited, by the host (``synchronize_event``) or by the compute
  stream (``wait_event``/``wait_stream``); a stream runs at most ``lag`` copies behind (0: at once; None: only when
  waited);
- the compute stream runs ``lag`` ops behind the host (None: until the host waits for it): a side-stream copy of a
  device storage written after the side stream's last wait on compute reads it unfinished (poisoned), and a freed
  block with a use recorded on compute stays reserved until compute passed it;
- a device source freed before its copy ran (no ``record_stream`` on the copying stream) poisons the destination;
- a side-stream copy into device memory the compute stream read after that stream's last wait on compute
  (write-after-read), and a block released while a copy into it is queued, raise ``SimulatedRaceError``;
- device memory with a capacity and pinned host memory (``memtrain.device.ledger``).

What it cannot see: kernel numerics (the CPU's kernels compute), ops other than copies issued on a side stream
(they run at once), the caching allocator's per-stream pools (a block freed is reusable by any stream at once) and
its fragmentation, a copy to the host made without the seam (``x.to("cpu")`` of device data on the loop's thread
counts as device memory: use ``acc.to_host``), NCCL, and any timing.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._mode_utils import no_dispatch

from memtrain.device.base import Accelerator, Placeable
from memtrain.device.ledger import DeviceLedger, HostLedger, LedgerMode
from memtrain.errors import ConfigError, MemtrainError


class SimulatedRaceError(MemtrainError):
    """An ordering a GPU would get wrong: a side-stream copy overwriting device memory the compute stream may still
    read, or a block released while a copy into it is queued."""


def poison_(t: torch.Tensor) -> None:
    """Fills ``t`` with what an unfinished copy leaves: NaN, or all bits set for integers (True for bool)."""
    with no_dispatch(), torch.no_grad():  # the destination may be a parameter
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(255)
        else:
            t.fill_(-1)


@dataclass(eq=False)
class SimEvent:
    stream: Any
    position: int


@dataclass(eq=False)
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor | None  # held: host memory
    source: weakref.ref | None  # a device source's storage, not held (the allocator could reuse it)
    view: tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]  # its offset, size, stride, dtype
    key: int
    racy: bool  # reads device data the compute stream had not finished when the copy was queued
    after: list[tuple[Any, int]] = field(default_factory=list)
    # A device source recorded on the copying stream: its block is not reused before the copy, so once its tensors
    # are gone the copy still reads what they held (a snapshot, not counted as device memory: the freed block is
    # counted as reserved, as the allocator holds it).
    kept: torch.Tensor | None = None

    def run(self) -> None:
        if self.dst.numel() and self.dst.untyped_storage().nbytes() == 0:
            raise SimulatedRaceError("a queued copy's destination was released before the copy ran. To resolve this "
                                     "error, wait for the copy's event (acc.wait_event) before releasing it.")
        src = self.src
        if src is None and self.source is not None and not self.racy:
            storage = self.source()
            if storage is not None:
                offset, size, stride, dtype = self.view
                with no_dispatch():
                    src = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
            else:
                src = self.kept
        if src is None or self.racy:
            poison_(self.dst)
            return
        with no_dispatch(), torch.no_grad():  # the destination may be a parameter
            self.dst.copy_(src)


class ComputeStream:
    """The stream the loop's ops run on: ``lag`` ops behind the host (None: until the host waits)."""

    name = "compute"

    def __init__(self, sim: SimulatedAccelerator):
        self.sim = sim
        self.synced = 0  # the clock the host last waited for

    @property
    def position(self) -> int:
        return self.sim.mode.clock

    def done(self) -> int:
        lag = self.sim.lag
        return max(self.synced, self.position - lag if lag is not None else 0)

    def passed(self, position: int) -> bool:
        return self.done() >= position


class SideStream:
    """A stream whose copies run behind the host (``lag`` at most queued; None: until waited)."""

    def __init__(self, sim: SimulatedAccelerator, name: str):
        self.sim = sim
        self.name = name
        self.queue: deque[_Copy] = deque()
        self.issued = 0
        self.done = 0
        self.waited_clock = 0  # the compute clock this stream last waited for
        self.after: list[tuple[Any, int]] = []  # other streams' positions its next copy waits for

    def __repr__(self) -> str:
        return f"SideStream({self.name}, issued={self.issued}, done={self.done})"

    @property
    def position(self) -> int:
        return self.issued

    def passed(self, position: int) -> bool:
        return self.done >= position

    def enqueue(self, op: _Copy) -> None:
        with self.sim.lock:
            op.after, self.after = self.after, []
            poison_(op.dst)
            self.queue.append(op)
            self.issued += 1
            lag = self.sim.lag
            while lag is not None and len(self.queue) > lag:
                self._run_one()

    def run_until(self, position: int) -> None:
        with self.sim.lock:
            while self.done < position and self.queue:
                self._run_one()

    def _run_one(self) -> None:
        op = self.queue.popleft()
        for stream, position in op.after:
            if isinstance(stream, SideStream):
                stream.run_until(position)
        op.run()
        self.done += 1


class SimulatedAccelerator(Accelerator):
    """An accelerator of ``capacity`` bytes whose tensors are CPU tensors (see the module's docstring)."""

    kind = "simulated"
    has_streams = True
    tracks_memory = True

    def __init__(self, capacity: int, *, lag: int | None = 1, host_capacity: int | None = None,
                 segments: bool = False):
        super().__init__(torch.device("cpu"))
        self.kind = "simulated"
        if lag is not None and lag < 0:
            raise ConfigError(f"SimulatedAccelerator(lag={lag}): a stream runs 0 or more ops behind. To resolve this "
                              "error, pass lag=0, 1, 3 or None (unbounded).")
        self.capacity = capacity
        self.lag = lag
        self.lock = threading.RLock()
        self.ledger = DeviceLedger(capacity, synchronize=self.synchronize, segments=segments)
        self.host_ledger = HostLedger(host_capacity)
        self.mode = LedgerMode(self)
        self.compute_stream = ComputeStream(self)
        self._streams: weakref.WeakSet[SideStream] = weakref.WeakSet()
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"SimulatedAccelerator({self.capacity} bytes, lag={self.lag})"

    @property
    def total_memory(self) -> int:
        return self.capacity

    def host_waited_compute(self) -> None:
        self.compute_stream.synced = self.mode.clock

    # -- streams and events ---------------------------------------------------------------------------------
    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in this device's memory (its ledger counts it), not in host RAM: both are CPU
        tensors here, and a host-only fast path (memtrain.optim.host_kernels) must not take the device's."""
        return self.ledger.is_device(tensor)

    def new_stream(self) -> SideStream:
        stream = SideStream(self, f"side{len(self._streams)}")
        self._streams.add(stream)
        return stream

    def current_stream(self) -> Any:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.compute_stream

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def record_event(self, stream: Any = None) -> SimEvent:
        stream = stream if stream is not None else self.current_stream()
        return SimEvent(stream, stream.position)

    def wait_event(self, event: Any, stream: Any = None) -> None:
        if event is None:
            return
        target = stream if stream is not None else self.current_stream()
        with self.lock:
            if isinstance(target, ComputeStream):
                if isinstance(event.stream, SideStream):  # compute runs on at once: the copies must be done
                    event.stream.run_until(event.position)
            elif isinstance(event.stream, ComputeStream):
                target.waited_clock = max(target.waited_clock, event.position)
            elif event.stream is not target:
                target.after.append((event.stream, event.position))

    def wait_stream(self, stream: Any, other: Any) -> None:
        self.wait_event(self.record_event(other), stream)

    def synchronize_event(self, event: Any) -> None:
        if event is None:
            return
        if isinstance(event.stream, SideStream):
            event.stream.run_until(event.position)
        else:
            self.compute_stream.synced = max(self.compute_stream.synced, event.position)

    def query(self, event: Any) -> bool:
        return event is None or event.stream.passed(event.position)

    def synchronize(self) -> None:
        with self.lock:
            for stream in list(self._streams):
                stream.run_until(stream.issued)
            self.host_waited_compute()

    # -- copies and allocation ------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Any = None) -> None:
        stream = stream if stream is not None else self.current_stream()
        if isinstance(stream, ComputeStream):
            dst.copy_(src)  # in stream order with the ops around it (through the ledger's mode)
            return
        stream.enqueue(self._copy_op(dst, src, stream))

    def _copy_op(self, dst: torch.Tensor, src: torch.Tensor, stream: SideStream) -> _Copy:
        ledger = self.ledger
        behind = max(stream.waited_clock, self.compute_stream.done())
        if ledger.is_device(dst) and ledger.read.get(dst.untyped_storage()._cdata, 0) > behind:
            raise SimulatedRaceError(
                f"a copy on {stream.name} overwrites device memory ({tuple(dst.shape)} {dst.dtype}) that the compute "
                "stream read after that stream last waited for it: on a GPU the copy can land before the kernels "
                "reading it ran. To resolve this error, make the side stream wait for the compute stream "
                "(acc.wait_stream(side, acc.current_stream())) before the copy.")
        view = (src.storage_offset(), tuple(src.shape), tuple(src.stride()), src.dtype)
        key = src.untyped_storage()._cdata
        if not ledger.is_device(src):
            return _Copy(dst, src, None, view, key, racy=False)
        racy = ledger.written.get(key, 0) > behind
        return _Copy(dst, None, weakref.ref(src.untyped_storage()), view, key, racy)

    def foreach_copy_(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, stream: Any = None) -> None:
        for dst, src in zip(dsts, srcs, strict=True):
            self.copy_(dst, src, stream=stream)

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype, *, stream: Any = None) -> torch.Tensor:
        with no_dispatch():
            t = torch.empty(shape, dtype=dtype)
        poison_(t)  # what the allocator hands out is not zeros
        self.ledger.add(t)
        return t

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        with self.lock:
            self.ledger.record_use(tensor, stream)
            if isinstance(stream, SideStream):
                key = tensor.untyped_storage()._cdata
                for op in stream.queue:  # the block is kept for the stream: its queued reads stay valid
                    storage = op.source() if op.key == key and op.source is not None else None
                    if storage is not None:
                        offset, size, stride, dtype = op.view
                        with no_dispatch():
                            op.kept = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride).clone()

    def pinned_empty(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        with no_dispatch():
            t = torch.empty(shape, dtype=dtype)
        self.host_ledger.add(t, rounded=True)
        return t

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with no_dispatch():
            t = torch.empty(numel, dtype=dtype)
        self.host_ledger.add(t, rounded=False)
        return t

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        storage = tensor.untyped_storage()
        old = storage.nbytes()
        if nbytes < old:
            self._check_no_pending_write(storage._cdata)
        storage.resize_(nbytes)
        self.ledger.resized(tensor, old)
        if nbytes > old and self.ledger.is_device(tensor):
            with no_dispatch():
                poison_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)))

    def _check_no_pending_write(self, key: int) -> None:
        with self.lock:
            for stream in list(self._streams):
                if any(op.dst.untyped_storage()._cdata == key for op in stream.queue):
                    raise SimulatedRaceError(
                        f"device memory released while a copy into it is still queued on {stream.name}: on a GPU "
                        "the copy would write memory the allocator already handed out again. To resolve this error, "
                        "wait for the copy's event (acc.wait_event) before releasing it.")

    def place(self, obj: Placeable) -> Placeable:
        if isinstance(obj, nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                self.ledger.add(t)
        else:
            self.ledger.add(obj)
        return obj

    def to_device(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        dst = self.empty(tuple(tensor.shape), tensor.dtype)
        if stream is not None:
            self.wait_event(self.record_event(), stream)  # allocated on compute (RealAccelerator.to_device's rule)
        self.copy_(dst, tensor, stream=stream)
        return dst

    def to_host(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        with no_dispatch():
            dst = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
        if stream is not None:  # asynchronous: torch takes it from its pinned cache, rounded up
            self.host_ledger.add(dst, rounded=True)
        self.copy_(dst, tensor, stream=stream)
        return dst

    # -- regions --------------------------------------------------------------------------------------------
    @contextmanager
    def compute(self) -> Iterator[None]:
        self.mode.compute_depth += 1
        try:
            yield
        finally:
            self.mode.compute_depth -= 1

    @contextmanager
    def host(self) -> Iterator[None]:
        self.mode.host_depth += 1
        try:
            yield
        finally:
            self.mode.host_depth -= 1

    # -- memory statistics ----------------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        return self.ledger.allocated

    def max_memory_allocated(self) -> int:
        return self.ledger.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.ledger.peak_reserved

    def memory_stats(self) -> dict[str, int]:
        return self.ledger.stats()

    def reset_peak_memory_stats(self) -> None:
        self.ledger.reset_peaks()

    def mem_get_info(self) -> tuple[int, int]:
        return self.capacity - self.ledger.reserved, self.capacity

    def empty_cache(self) -> None:
        pass

    def host_pinned_bytes(self) -> tuple[int, int]:
        return self.host_ledger.current, self.host_ledger.peak

    # -- random numbers: the CPU generator draws for the device -----------------------------------------------
    def get_rng_state(self) -> torch.Tensor | None:
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        pass
