"""What every device offers memtrain: the plain CPU's answers (no streams, no allocator), which the accelerators
override. Code asks ``acc.has_streams``, never ``device.type == "cuda"``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

Placeable = nn.Module | torch.Tensor


class Accelerator:
    """The plain CPU: tensors, copies and "device" memory are the host's; streams and events do not exist (each
    method that takes one accepts None and does the work at once)."""

    kind = "cpu"
    has_streams = False
    tracks_memory = False  # whether memory_allocated() and the peaks mean anything
    pins_host_memory = False  # whether page-locked host memory exists to copy from (torch's pin_memory())

    def __init__(self, device: torch.device | None = None):
        self.device = device if device is not None else torch.device("cpu")
        self.kind = self.device.type  # "cpu", or a stream-less accelerator's type (e.g. "mps")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    @property
    def total_memory(self) -> int:
        """The machine's physical memory (memtrain.measure.available_host_bytes says what a cgroup leaves)."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # -- streams and events ---------------------------------------------------------------------------------
    def new_stream(self) -> Any:
        """A side stream: work on it overlaps the compute stream's (None where there are no streams)."""
        return None

    def current_stream(self) -> Any:
        """The stream the calling thread's ops are issued on (the compute stream unless use_stream)."""
        return None

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Issues the block's copies (``copy_`` with no stream) and allocations on ``stream``."""
        yield

    def record_event(self, stream: Any = None) -> Any:
        """An event after everything issued on ``stream`` so far (default: the current stream)."""
        return None

    def wait_event(self, event: Any, stream: Any = None) -> None:
        """``stream`` (default: the current one) runs nothing issued later until ``event``: the host goes on."""

    def wait_stream(self, stream: Any, other: Any) -> None:
        """``stream`` runs nothing issued later until everything issued on ``other`` so far."""

    def synchronize_event(self, event: Any) -> None:
        """The host waits for ``event`` (e.g. the optimizer's worker, before reading landed gradients)."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` completed, without waiting."""
        return True

    def synchronize(self) -> None:
        """The host waits for every stream of the device."""

    # -- copies and allocation ------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Any = None) -> None:
        """An asynchronous copy on ``stream`` (default: the current one): ``dst`` is only readable once an event
        recorded after it is waited, and ``src`` must stay alive (or be recorded on ``stream``) until then."""
        dst.copy_(src)

    def foreach_copy_(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, stream: Any = None) -> None:
        """``copy_`` of each pair, in one launch where the device has one."""
        if dsts:
            torch._foreach_copy_(list(dsts), list(srcs))

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype, *, stream: Any = None) -> torch.Tensor:
        """Uninitialised device memory, allocated in ``stream``'s order (default: the current stream)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tells the allocator that ``stream`` uses ``tensor``: its block is not reused before ``stream`` passed
        the point where the tensor is freed. It holds the block: prefer allocating on the stream that frees it."""

    def pinned_empty(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device copies to and from asynchronously (page-locked where that exists)."""
        return torch.empty(shape, dtype=dtype)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Like ``pinned_empty``, at its exact size (no power-of-two rounding): for large, long-lived buffers."""
        return torch.empty(numel, dtype=dtype)

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        """Resizes ``tensor``'s storage to ``nbytes`` (0 frees its memory; every view sees it come back)."""
        tensor.untyped_storage().resize_(nbytes)

    def place(self, obj: Placeable) -> Placeable:
        """``obj`` on this device: a module is moved in place (like ``.to(device)``), a tensor is returned moved."""
        return obj.to(self.device)

    def to_device(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        """A copy of a host tensor on the device (on ``stream``: readable once an event after it is waited)."""
        return tensor.to(self.device)

    def to_host(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        """A copy of ``tensor`` in host memory (on ``stream``: readable once an event after it is waited)."""
        return tensor.to("cpu", copy=True)

    # -- regions (the simulated ledger's; nothing elsewhere) ------------------------------------------------
    @contextmanager
    def compute(self) -> Iterator[None]:
        """A training step's forward, backward and step: the simulated device counts what they allocate."""
        yield

    @contextmanager
    def host(self) -> Iterator[None]:
        """Host work on the loop's thread inside ``compute()``: what it allocates is host memory."""
        yield

    # -- memory statistics ----------------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        """Device bytes held by live tensors now (0 where memtrain cannot tell)."""
        return 0

    def max_memory_allocated(self) -> int:
        """The most device bytes held by tensors since the last ``reset_peak_memory_stats``."""
        return 0

    def max_memory_reserved(self) -> int:
        """The most device bytes the allocator held (tensors and its cache) since the last reset."""
        return 0

    def memory_stats(self) -> dict[str, int]:
        """The allocator's counters (``num_alloc_retries``, ``num_ooms``, ...); empty where there is none."""
        return {}

    def reset_peak_memory_stats(self) -> None:
        """Starts the peaks again from what is held now."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        total = self.total_memory
        return total, total

    def empty_cache(self) -> None:
        """Returns the allocator's cached free blocks to the device."""

    def host_pinned_bytes(self) -> tuple[int, int]:
        """(pinned host bytes now, at most) as far as memtrain can tell (the simulator's host ledger)."""
        return 0, 0

    # -- random numbers -------------------------------------------------------------------------------------
    def get_rng_state(self) -> torch.Tensor | None:
        """The device generator's state (None where the device has none of its own: the CPU's is torch's)."""
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        pass
