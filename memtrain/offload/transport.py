"""The device-specific half of activation offload: host memory, asynchronous copies and events, over the device
seam (``memtrain.device``). One ``Transport``: pinned slabs and one side stream where the device has streams (a GPU,
the simulated accelerator); plain copies where it has none (``CpuTransport``: tests and dry runs)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from memtrain.device import Accelerator, accelerator

_NOOP_WARNED = False

Segments = list[tuple[int, torch.Tensor]]  # (offset in the tensor's bytes, host view) pieces of one block


class Transport:
    """Pinned host slabs and one side stream for every copy, both directions (plain copies without streams).

    ``copy_to_host`` and ``copy_to_device`` are asynchronous; the event they return is done when the copy is.
    ``wait`` makes the *current* (compute) stream wait for an event without blocking the host; the compute stream
    must wait for a ``copy_to_device`` before it reads the tensor or frees it.
    ``allocate_host`` raises ``RuntimeError`` when the host memory cannot be had.

    The synchronisation lives in the public methods; each stream operation they use is a one-line method at the
    bottom, so that a model of two streams (tests/offload_stream_model.py) runs this very logic and fails when a
    wait or ``wait_stream`` goes missing; the simulated accelerator runs it whole.
    """

    def __init__(self, acc: Accelerator):
        self.acc = acc
        self.device = acc.device
        self.stream = self._new_stream() if acc.has_streams else None

    def __reduce__(self) -> tuple[Any, ...]:
        # A stream cannot be pickled: a model saved with an offloader gets a fresh one where it is loaded.
        return _transport, (str(self.device), self.acc.has_streams)

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return self._pinned(nbytes)  # a RuntimeError when it cannot: HostPool keeps the tensors on the device

    def copy_to_host(self, src: torch.Tensor, segments: Segments, tag: int) -> Any:
        pieces = [(host, src[offset:offset + host.numel()]) for offset, host in segments]
        if self.stream is not None:
            # The kernels writing src are queued on the compute stream: the copy must start after them.
            self._wait_stream(self.stream, self._current())
        for host, piece in pieces:
            self._copy(host, piece, self.stream)
        return self._record_event(self.stream) if self.stream is not None else None

    def copy_to_device(self, segments: Segments, nbytes: int, tag: int) -> tuple[torch.Tensor, Any]:
        # Allocated on the compute stream (FSDP2's pattern): once freed, the allocator reuses the memory in that
        # stream's order, with no record_stream (a side-stream allocation used by compute stays reserved until
        # compute passes its free, and reserved memory grows while the host runs ahead). The memory may be what
        # compute's earlier kernels still read: the side stream copies once compute reached this point.
        dst = self._empty(nbytes)
        if self.stream is not None:
            self._wait_event(self.stream, self._record_event(self._current()))
        for offset, host in segments:
            self._copy(dst[offset:offset + host.numel()], host, self.stream)
        return dst, self._record_event(self.stream) if self.stream is not None else None

    def wait(self, event: Any) -> None:
        if event is not None:
            self._wait_event(self._current(), event)

    def query(self, event: Any) -> bool:
        return event is None or self._query(event)

    # -- the stream operations (one each) -------------------------------------------------------------------
    def _new_stream(self) -> Any:
        return self.acc.new_stream()

    def _current(self) -> Any:
        return self.acc.current_stream()

    def _pinned(self, nbytes: int) -> torch.Tensor:
        # The pool's slabs are a power of two (offload_activations): the host allocator's rounding costs nothing.
        return self.acc.pinned_empty(nbytes, torch.uint8)

    def _empty(self, nbytes: int) -> torch.Tensor:
        return self.acc.empty(nbytes, torch.uint8)  # on the current (compute) stream

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        self.acc.copy_(dst, src, stream=stream)

    def _wait_stream(self, stream: Any, other: Any) -> None:
        self.acc.wait_stream(stream, other)

    def _record_event(self, stream: Any) -> Any:
        return self.acc.record_event(stream)

    def _wait_event(self, stream: Any, event: Any) -> None:
        self.acc.wait_event(event, stream=stream)

    def _query(self, event: Any) -> bool:
        return self.acc.query(event)


class CpuTransport(Transport):
    """The offload logic on the plain CPU: "host" blocks are ordinary memory and copies are synchronous.

    Nothing is saved (the device *is* the host); it exists so that tests and dry runs (what would move, how
    many bytes) run the same code as the GPU, whether or not a simulation is active.
    """

    def __init__(self) -> None:
        super().__init__(Accelerator())

    def __reduce__(self) -> tuple[Any, ...]:
        return CpuTransport, ()


def _transport(device: str, streams: bool = True) -> Transport | None:
    """A transport for ``device``, or None (a disabled offloader, said once) where that device has no streams here
    (saved on a GPU, loaded on a CPU-only machine)."""
    acc = accelerator(device) if device_exists(torch.device(device)) else None
    if acc is not None and acc.has_streams == streams:
        return Transport(acc)
    warn_noop(f"the offloader was saved on {device}, which this machine does not have")
    return None


def device_exists(device: torch.device) -> bool:
    """Whether this machine has ``device`` (the seam hands out an accelerator for any device name)."""
    if device.type in ("cpu", "meta"):
        return True
    try:
        module = torch.get_device_module(device.type)
        return bool(module.is_available()) and (device.index or 0) < module.device_count()
    except (RuntimeError, AttributeError):
        return False


# NOTE: what models pickled before the device seam name.
_cuda_transport = _transport


def warn_noop(why: str) -> None:
    global _NOOP_WARNED
    if not _NOOP_WARNED:
        _NOOP_WARNED = True
        warnings.warn(f"offload_activations: {why}, so saved activations already live in host memory; the context "
                      "does nothing.", stacklevel=3)
