"""A real accelerator with streams (CUDA, ROCm through torch.cuda, XPU), through its device module
(``torch.get_device_module(kind)``: ``Stream``, ``Event``, ``stream``, the allocator's statistics, the generator),
which every torch from 2.6 has; ``torch.accelerator`` gains the same calls only from 2.8-2.9. Page-locked memory:
torch's host allocator for small buffers, ``cudaHostRegister`` of an ordinary allocation for large ones (exact
size: the allocator rounds each request up to a power of two)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from memtrain.device.base import Accelerator, Placeable

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class RealAccelerator(Accelerator):
    """One device of the machine's accelerator (``torch.device("cuda", 0)``)."""

    has_streams = True
    tracks_memory = True
    pins_host_memory = True

    def __init__(self, device: torch.device):
        module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else module.current_device()
        super().__init__(torch.device(device.type, index))
        self.kind = device.type
        self.module = module

    @property
    def total_memory(self) -> int:
        return int(self.module.get_device_properties(self.device).total_memory)

    # -- streams and events ---------------------------------------------------------------------------------
    def new_stream(self) -> Any:
        return self.module.Stream(self.device)

    def current_stream(self) -> Any:
        return self.module.current_stream(self.device)

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        with self.module.stream(stream):
            yield

    def record_event(self, stream: Any = None) -> Any:
        # blocking: a host wait (synchronize_event, on the optimizer's worker) sleeps instead of spinning a core
        # the CPU step needs.
        event = self.module.Event(blocking=True) if self.kind == "cuda" else self.module.Event()
        event.record(stream if stream is not None else self.current_stream())
        return event

    def wait_event(self, event: Any, stream: Any = None) -> None:
        if event is not None:
            (stream if stream is not None else self.current_stream()).wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def synchronize_event(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self) -> None:
        self.module.synchronize(self.device)

    # -- copies and allocation ------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Any = None) -> None:
        with self.use_stream(stream):
            dst.copy_(src, non_blocking=True)

    def foreach_copy_(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, stream: Any = None) -> None:
        if dsts:
            with self.use_stream(stream):
                torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype, *, stream: Any = None) -> torch.Tensor:
        with self.use_stream(stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def pinned_empty(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype)
        if numel == 0:
            return buffer
        return _register(buffer, self) if self.kind == "cuda" else buffer.pin_memory()

    def place(self, obj: Placeable) -> Placeable:
        return obj.to(self.device)

    def to_device(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        # Allocated on the compute stream, copied on ``stream`` once compute reached this point (FSDP2's rule: a
        # block allocated on a side stream and used on compute would need record_stream, which holds it).
        dst = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        if stream is not None:
            self.wait_event(self.record_event(), stream)
        self.copy_(dst, tensor, stream=stream)
        return dst

    def to_host(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        # Into torch's pinned cache when asynchronous: the caller waits an event recorded after it before reading.
        with self.use_stream(stream):
            return tensor.to("cpu", non_blocking=stream is not None, copy=True)

    # -- memory statistics ----------------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        return int(self.module.memory_allocated(self.device))

    def max_memory_allocated(self) -> int:
        return int(self.module.max_memory_allocated(self.device))

    def max_memory_reserved(self) -> int:
        return int(self.module.max_memory_reserved(self.device))

    def memory_stats(self) -> dict[str, int]:
        return dict(self.module.memory_stats(self.device))

    def reset_peak_memory_stats(self) -> None:
        self.module.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.module.mem_get_info(self.device)
        return int(free), int(total)

    def empty_cache(self) -> None:
        self.module.empty_cache()

    # -- random numbers -------------------------------------------------------------------------------------
    def get_rng_state(self) -> torch.Tensor | None:
        return self.module.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self.module.set_rng_state(state, self.device)


def _register(buffer: torch.Tensor, acc: RealAccelerator) -> torch.Tensor:
    """``buffer`` page-locked by cudaHostRegister (exact size; the registration lives as long as its memory), or
    copied into torch's pinned allocator where the runtime refuses."""
    cudart = torch.cuda.cudart()
    register = getattr(cudart, "cudaHostRegister", None)
    if register is None:
        return buffer.pin_memory()
    nbytes = buffer.numel() * buffer.element_size()
    # On a throwaway thread: a refused registration leaves the CUDA runtime's per-thread "last error" set, which
    # the next kernel launch's error check on that thread would report as its own failure. A new thread starts on
    # device 0: it is set to this process's device first (no context on GPU 0 for every rank), and the memory is
    # registered as portable (page-locked for every device's context, as torch's own host registration does).
    def register_here() -> int:
        torch.cuda.set_device(acc.device)
        return int(register(buffer.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE))

    with ThreadPoolExecutor(max_workers=1) as once:
        status = once.submit(register_here).result()
    if status != 0:
        pinned = buffer.pin_memory()
        warnings.warn(f"cudaHostRegister refused {nbytes} bytes (error {status}; a locked-memory limit, see ulimit -l):"
                      f" pinned through torch's allocator instead, {pinned.untyped_storage().nbytes()} bytes rounded "
                      "up to a power of two. To pin the exact size, raise the limit (ulimit -l unlimited).",
                      stacklevel=4)
        return pinned
    weakref.finalize(buffer.untyped_storage(), _unregister, cudart, buffer.data_ptr(), acc.device)
    return buffer


def _unregister(cudart: Any, pointer: int, device: torch.device) -> None:
    # A copy still queued may read or write the buffer: it must finish before the memory stops being page-locked.
    torch.cuda.synchronize(device)
    cudart.cudaHostUnregister(pointer)


class StreamlessAccelerator(RealAccelerator):
    """An accelerator whose torch module has no streams (Apple's MPS: one queue): copies are ordered with compute
    and synchronous for the host, pinned memory means nothing, and the device generator is its module's."""

    has_streams = False
    tracks_memory = False  # torch.mps names its statistics otherwise; memtrain reports no allocator peak there
    pins_host_memory = False

    def __init__(self, device: torch.device):
        module = torch.get_device_module(device.type)
        current = getattr(module, "current_device", None)
        Accelerator.__init__(self, torch.device(device.type, device.index if device.index is not None
                                                else current() if current is not None else 0))
        self.module = module

    @property
    def total_memory(self) -> int:
        return Accelerator().total_memory  # unified memory: the machine's

    new_stream = Accelerator.new_stream
    current_stream = Accelerator.current_stream
    use_stream = Accelerator.use_stream
    record_event = Accelerator.record_event
    wait_event = Accelerator.wait_event
    wait_stream = Accelerator.wait_stream
    synchronize_event = Accelerator.synchronize_event
    query = Accelerator.query
    copy_ = Accelerator.copy_
    foreach_copy_ = Accelerator.foreach_copy_
    empty = Accelerator.empty
    record_stream = Accelerator.record_stream
    pinned_empty = Accelerator.pinned_empty
    host_buffer = Accelerator.host_buffer
    to_device = Accelerator.to_device
    to_host = Accelerator.to_host
    memory_allocated = Accelerator.memory_allocated
    max_memory_allocated = Accelerator.max_memory_allocated
    max_memory_reserved = Accelerator.max_memory_reserved
    memory_stats = Accelerator.memory_stats
    reset_peak_memory_stats = Accelerator.reset_peak_memory_stats
    mem_get_info = Accelerator.mem_get_info
