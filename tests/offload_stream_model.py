"""Activation offload on the CPU: the pack / unpack / prefetch logic through a model of two CUDA streams.

``FakeTransport`` runs ``Transport``'s own synchronisation logic over a model of the compute stream and the
side stream (see its docstring): a missing wait or ``wait_stream``, a restored block freed unwaited, or a source
freed before its copy ran, shows up as NaN gradients or as an error; it logs the copies in order so that what moves, when and
in which order can be checked.

The stream model and the small models the offload tests share."""

from __future__ import annotations

import collections
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from memtrain.device import Accelerator
from memtrain.models import GPT
from memtrain.offload import ActivationOffloader, Transport

POISON = 255  # a byte that makes NaN of every float dtype


class _WithStreams(Accelerator):
    """The plain CPU, saying it has streams: FakeTransport overrides every stream operation the transport uses."""

    has_streams = True


class FakeEvent:
    def __init__(self, kind: str, tag: int) -> None:
        self.kind, self.tag, self.done = kind, tag, False
        self.block: DeviceBlock | None = None  # the destination of a copy to the device


class DeviceBlock:
    """Device memory a copy to the device fills, allocated on the compute stream, as the caching allocator sees it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref = StorageWeakRef(tensor.untyped_storage())
        self.cdata = tensor.untyped_storage()._cdata
        self.nbytes = tensor.numel()
        self.read_by_compute = False  # the compute stream waited for its copy: it reads the block


class FakeTransport(Transport):
    """``Transport``'s logic over a model of two CUDA streams on the CPU (its stream operations overridden below).

    - The compute stream is the CPU itself (its kernels are done at once) with a clock: it ticks at every call
      into the transport, since the offloader's caller computed in between; a tensor handed to ``copy_to_host``
      was written at the current tick.
    - The side stream runs its copies ``lag`` transfers after they are issued, in order. A copy to the host reads
      its source when it runs, holding it weakly (a queued kernel keeps no memory alive): it writes NaN bytes when
      the source died first, or when the side stream had not waited for the compute stream (``wait_stream``)
      since the source was written. A copy to the device fills its destination only when it runs (NaN before),
      so a missing wait on its event reads NaN.
    - Device memory for a copy to the device is allocated on the compute stream, which reuses it as soon as it
      is freed: the compute stream must have waited for the copy's event before the memory is freed (used or
      not), else the copy could still be writing memory compute reuses. The next allocation raises then.
    - ``refuse_pinning_after``: that many host slabs are pinned, then pinning fails (host memory exhausted).
    """

    def __init__(self, lag: int = 3, refuse_pinning_after: int | None = None):
        self.lag = lag
        self.refuse_pinning_after = refuse_pinning_after
        self.queue: collections.deque[tuple[list, FakeEvent]] = collections.deque()
        self.log: list[tuple] = []
        self.slabs = 0
        self.host_offsets: list[int] = []  # host address of each copy to the host, in order
        self.hazards: list[str] = []  # data races seen by the copies that ran
        self.clock = 0  # the compute stream's progress
        self.side_synced = 0  # the compute clock the side stream last waited for
        self.blocks: list[DeviceBlock] = []
        self.sources: list[tuple[weakref.ref, int]] = []  # the offloader's handle on each source, with its bytes
        self._ops: list = []  # side-stream copies issued since the last event
        self._transfer: tuple[str, int, int] = ("", -1, 0)  # (direction, tag, compute tick its source was written)
        self._block: DeviceBlock | None = None
        super().__init__(_WithStreams())

    def __reduce__(self):  # a model holding this transport pickles as a fresh one
        return type(self), (self.lag, self.refuse_pinning_after)

    # -- what the offloader calls: log, and tick the compute clock
    def allocate_host(self, nbytes: int) -> torch.Tensor:
        self.clock += 1
        return super().allocate_host(nbytes)

    def copy_to_host(self, src, segments, tag):
        self.clock += 1
        self.log.append(("d2h", tag, src.numel()))
        self.host_offsets.append(segments[0][1].data_ptr())
        self._transfer = ("d2h", tag, self.clock)
        self.sources.append((weakref.ref(src), src.numel()))
        return super().copy_to_host(src, segments, tag)

    def copy_to_device(self, segments, nbytes, tag):
        self.clock += 1
        self.log.append(("h2d", tag, nbytes))
        self._transfer = ("h2d", tag, self.clock)
        return super().copy_to_device(segments, nbytes, tag)

    def wait(self, event) -> None:
        # The compute stream waits: the side stream must have reached the event.
        self.clock += 1
        if event is not None:  # None: waited already
            self.log.append(("wait", event.kind, event.tag))
        super().wait(event)

    def query(self, event) -> bool:
        self.clock += 1
        return super().query(event)

    # -- the stream operations Transport is built from
    def _new_stream(self):
        return "side"

    def _current(self):
        return "compute"

    def _pinned(self, nbytes: int) -> torch.Tensor:
        if self.refuse_pinning_after is not None and self.slabs >= self.refuse_pinning_after:
            raise RuntimeError("CUDA error: out of memory (FakeTransport refuses to pin more host memory)")
        self.slabs += 1
        self.log.append(("slab", nbytes))
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _empty(self, nbytes: int) -> torch.Tensor:
        self._check_frees()
        dst = torch.full((nbytes,), POISON, dtype=torch.uint8)
        self._block = DeviceBlock(dst)
        self.blocks.append(self._block)
        return dst

    def _copy(self, dst, src, stream) -> None:
        assert stream == "side", stream
        direction, tag, written = self._transfer
        if direction == "h2d":
            self._ops.append(lambda: dst.copy_(src))
            return
        ordered = self.side_synced >= written
        ref, offset, n = StorageWeakRef(src.untyped_storage()), src.storage_offset(), src.numel()

        def run() -> None:
            if not ordered:
                self.hazards.append(f"d2h {tag}: read before the compute stream wrote it (no wait_stream)")
                dst.fill_(POISON)
            elif ref.expired():
                self.hazards.append(f"d2h {tag}: its source was freed before the copy ran")
                dst.fill_(POISON)
            else:
                storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, offset, (n,)))

        self._ops.append(run)

    def _wait_stream(self, stream, other) -> None:
        assert (stream, other) == ("side", "compute"), (stream, other)
        self.side_synced = self.clock

    def _record_event(self, stream):
        if stream == "compute":  # for the side stream to wait on: it then runs after what compute did so far
            event = FakeEvent("compute", self.clock)
            event.done = True
            return event
        assert stream == "side", stream
        direction, tag, _ = self._transfer
        event = FakeEvent(direction, tag)
        event.block, self._block = (self._block if direction == "h2d" else None), None
        self.queue.append((self._ops, event))
        self._ops = []
        self._advance(self.lag)
        return event

    def _wait_event(self, stream, event) -> None:
        if stream == "side":
            assert event.kind == "compute", event.kind
            self.side_synced = max(self.side_synced, event.tag)
            return
        assert stream == "compute", stream
        while not event.done:
            self._advance(len(self.queue) - 1)
        if event.block is not None:
            event.block.read_by_compute = True

    def _query(self, event) -> bool:
        return event.done

    # -- the model's bookkeeping
    def _advance(self, keep: int) -> None:
        while len(self.queue) > keep:
            ops, event = self.queue.popleft()
            for op in ops:
                op()
            event.done = True

    def _check_frees(self) -> None:
        for block in [b for b in self.blocks if b.ref.expired()]:
            self.blocks.remove(block)
            if not block.read_by_compute:
                raise AssertionError(
                    f"a restored block of {block.nbytes} bytes was freed before the compute stream waited for its "
                    "copy: compute could reuse the memory while the side stream still writes it")

    def live_device_bytes(self) -> int:
        """Bytes of device memory the offload still holds: restored blocks, and the sources of copies to the host
        that the offloader still references."""
        return (sum(b.nbytes for b in self.blocks if not b.ref.expired())
                + sum(n for ref, n in self.sources if ref() is not None))

    def tags(self, kind: str) -> list[int]:
        return [entry[1] for entry in self.log if entry[0] == kind]


def offloader(transport=None, **kwargs) -> ActivationOffloader:
    kwargs.setdefault("min_bytes", 1)
    kwargs.setdefault("host_budget_bytes", 2**24)
    kwargs.setdefault("slab_bytes", 2**16)
    return ActivationOffloader(transport or FakeTransport(), **kwargs)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert torch.equal(a[name], b[name]), f"{name}: max abs diff {diff}"


def gpt_step(model: GPT, idx: torch.Tensor, context=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if context is None:
        loss = model(idx, idx)
    else:
        with context:
            loss = model(idx, idx)
    loss.backward()
    return grads(model)


class Chain(nn.Module):
    """Layers of distinct widths, so every saved tensor has its own size: the copy log names them."""

    def __init__(self, widths: tuple[int, ...] = (8, 12, 16, 20, 24, 28)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))  # tanh saves its output: one more saved tensor per layer
        return x


def chain_step(model: nn.Module, x: torch.Tensor, off: ActivationOffloader | None = None) -> dict:
    model.zero_grad(set_to_none=True)
    if off is None:
        model(x).square().sum().backward()
    else:
        with off:
            loss = model(x).square().sum()
        loss.backward()
    return grads(model)
