"""The device-specific half of activation offload: host memory, asynchronous copies and events behind a small
``Transport`` (``CudaTransport``: pinned slabs and one side stream; ``CpuTransport``: the same logic with plain
copies, for tests and dry runs)."""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch

_NOOP_WARNED = False

Segments = list[tuple[int, torch.Tensor]]  # (offset in the tensor's bytes, host view) pieces of one block


class Transport(Protocol):
    """The device-specific half of offloading: host slabs, asynchronous copies, events.

    ``copy_to_host`` and ``copy_to_device`` are asynchronous; the event they return is done when the copy is.
    ``wait`` makes the *current* (compute) stream wait for an event without blocking the host.
    ``allocate_host`` raises ``RuntimeError`` when the host memory cannot be had.
    """

    device: torch.device

    def allocate_host(self, nbytes: int) -> torch.Tensor: ...

    def copy_to_host(self, src: torch.Tensor, segments: Segments, tag: int) -> Any: ...

    def copy_to_device(self, segments: Segments, nbytes: int, tag: int) -> tuple[torch.Tensor, Any]: ...

    def wait(self, event: Any) -> None: ...

    def query(self, event: Any) -> bool: ...

    def hand_over(self, tensor: torch.Tensor) -> None: ...


class CpuTransport:
    """The offload logic on the CPU: "host" blocks are ordinary memory and copies are synchronous.

    Nothing is saved (the device *is* the host); it exists so that tests and dry runs (what would move, how
    many bytes) run the same code as the GPU.
    """

    device = torch.device("cpu")

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_to_host(self, src: torch.Tensor, segments: Segments, tag: int) -> Any:
        for offset, host in segments:
            host.copy_(src[offset:offset + host.numel()])
        return None

    def copy_to_device(self, segments: Segments, nbytes: int, tag: int) -> tuple[torch.Tensor, Any]:
        dst = torch.empty(nbytes, dtype=torch.uint8)
        for offset, host in segments:
            dst[offset:offset + host.numel()].copy_(host)
        return dst, None

    def wait(self, event: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def hand_over(self, tensor: torch.Tensor) -> None:
        pass


class CudaTransport:
    """Pinned host slabs and one side stream for every copy, both directions.

    The synchronisation lives in the public methods; each stream operation they use is a one-line method at the
    bottom, so that a model of two streams (tests/test_offload_transport.py) runs this very logic on the CPU and fails
    when a wait, ``wait_stream`` or ``record_stream`` goes missing.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = self._new_stream()

    def __reduce__(self) -> tuple[Any, ...]:
        # A stream cannot be pickled: a model saved with an offloader gets a fresh one where it is loaded.
        return _cuda_transport, (str(self.device),)

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return self._pinned(nbytes)  # a RuntimeError when it cannot: HostPool keeps the tensors on the device

    def copy_to_host(self, src: torch.Tensor, segments: Segments, tag: int) -> Any:
        # The kernels writing src are queued on the compute stream: the copy must start after them.
        self._wait_stream(self.stream, self._current())
        for offset, host in segments:
            self._copy(host, src[offset:offset + host.numel()], self.stream)
        return self._record_event(self.stream)

    def copy_to_device(self, segments: Segments, nbytes: int, tag: int) -> tuple[torch.Tensor, Any]:
        # Allocated on the side stream, the destination is free there at once: the copy need not wait for the
        # compute stream (which may be far behind the host), so a prefetch really starts early.
        dst = self._empty(nbytes, self.stream)
        for offset, host in segments:
            self._copy(dst[offset:offset + host.numel()], host, self.stream)
        return dst, self._record_event(self.stream)

    def wait(self, event: Any) -> None:
        self._wait_event(self._current(), event)

    def query(self, event: Any) -> bool:
        return self._query(event)

    def hand_over(self, tensor: torch.Tensor) -> None:
        # Allocated on the side stream, used on the compute stream: without this, the allocator could hand the
        # memory to the next prefetch while backward still reads it.
        self._record_stream(tensor, self._current())

    # -- the CUDA calls (one each) ------------------------------------------------------------------------
    def _new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def _current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def _pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _empty(self, nbytes: int, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def _wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def _record_event(self, stream: Any) -> Any:
        return stream.record_event()

    def _wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def _query(self, event: Any) -> bool:
        return event.query()

    def _record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def _cuda_transport(device: str) -> CudaTransport | None:
    """A transport for ``device``, or None (a disabled offloader, said once) where that device does not exist."""
    index = torch.device(device).index or 0
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        return CudaTransport(torch.device(device))
    warn_noop(f"the offloader was saved on {device}, which this machine does not have")
    return None


def warn_noop(why: str) -> None:
    global _NOOP_WARNED
    if not _NOOP_WARNED:
        _NOOP_WARNED = True
        warnings.warn(f"offload_activations: {why}, so saved activations already live in host memory; the context "
                      "does nothing.", stacklevel=3)
