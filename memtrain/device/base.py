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
        return None

    def current_stream(self) -> Any:
        return None

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        yield

    def record_event(self, stream: Any = None) -> Any:
        return None

    def wait_event(self, event: Any, stream: Any = None) -> None:
        pass

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def synchronize_event(self, event: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    # -- copies and allocation ------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor, *, stream: Any = None) -> None:
        dst.copy_(src)

    def foreach_copy_(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, stream: Any = None) -> None:
        if dsts:
            torch._foreach_copy_(list(dsts), list(srcs))

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype, *, stream: Any = None) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def pinned_empty(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device copies to and from asynchronously (page-locked where that exists)."""
        return torch.empty(shape, dtype=dtype)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Like ``pinned_empty``, at its exact size (no power-of-two rounding): for large, long-lived buffers."""
        return torch.empty(numel, dtype=dtype)

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        tensor.untyped_storage().resize_(nbytes)

    def place(self, obj: Placeable) -> Placeable:
        """``obj`` on this device: a module is moved in place (like ``.to(device)``), a tensor is returned moved."""
        return obj.to(self.device)

    def to_device(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
        return tensor.to(self.device)

    def to_host(self, tensor: torch.Tensor, *, stream: Any = None) -> torch.Tensor:
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
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def max_memory_reserved(self) -> int:
        return 0

    def memory_stats(self) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        total = self.total_memory
        return total, total

    def empty_cache(self) -> None:
        pass

    def host_pinned_bytes(self) -> tuple[int, int]:
        """(pinned host bytes now, at most) as far as memtrain can tell (the simulator's host ledger)."""
        return 0, 0

    # -- random numbers -------------------------------------------------------------------------------------
    def get_rng_state(self) -> torch.Tensor | None:
        """The device generator's state (None where the device has none of its own: the CPU's is torch's)."""
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        pass
