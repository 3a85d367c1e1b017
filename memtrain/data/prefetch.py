"""Device prefetch: the host->device copy of batch n+1 runs on a side stream during the compute of batch n (through
the device seam, ``memtrain.device``)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from memtrain.data.loader import parse_device
from memtrain.device import Accelerator, accelerator
from memtrain.errors import ConfigError


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Applies ``fn`` to every tensor in ``batch`` (nested tuples, named tuples, lists, mappings, dataclasses)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple such as TokenBatch
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    if isinstance(batch, MutableMapping):
        mapped = copy.copy(batch)  # keeps the mapping's own type (e.g. a Hugging Face BatchEncoding)
        mapped.update({k: map_tensors(fn, v) for k, v in batch.items()})
        return mapped
    if isinstance(batch, Mapping):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: map_tensors(fn, getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


class DevicePrefetcher:
    """Iterates ``loader`` with every batch already on ``device``: hides the copy behind compute, at the price of
    one more batch resident on the device.

    Where the device has streams (``memtrain.device``: a GPU, the simulated accelerator), batch n+1 is copied on a
    side stream while the caller computes on batch n; the copy is asynchronous only from pinned memory
    (``make_loader`` pins when batches go to an accelerator). A batch's device memory is allocated on the compute
    stream (FSDP2's pattern: once the caller drops the batch, the allocator reuses it in compute-stream order, with
    no ``record_stream``, so reserved memory does not grow while the host runs ahead); the side stream copies once
    the compute stream reached that point, and the compute stream waits for an event recorded after the copies
    before the batch is handed out. On the CPU it is a plain pass-through; on other devices it copies synchronously. The batches and their order
    are the loader's. Tensors nested in tuples, named tuples, lists, mappings and dataclasses are moved; other
    values pass through.

    Example:
        >>> prefetcher = DevicePrefetcher(make_loader(list(range(4)), batch_size=2, num_workers=0,
        ...                               machine=Machine(1, None)), "cpu")
        >>> [b.tolist() for b in prefetcher]
        [[0, 1], [2, 3]]
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str):
        self.loader = loader
        problems: list[str] = []
        self.device = parse_device(device, problems)
        ConfigError.raise_if(problems)
        self.acc = _streams_of(self.device)
        if self.acc is not None:
            self.device = self.acc.device  # "cuda" -> "cuda:<current>"
        self.stream = self.acc.new_stream() if self.acc is not None else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.stream is not None:
            yield from self._stream_batches()
        elif self.device.type == "cpu":
            yield from self.loader
        else:
            for batch in self.loader:
                yield map_tensors(lambda t: t.to(self.device), batch)

    def _copy_next(self, batches: Iterator[Any]) -> tuple[bool, Any, Any]:
        try:
            host = next(batches)
        except StopIteration:
            return False, None, None
        acc = self.acc
        # The batch's memory may be what compute's earlier kernels still read: the copies start once compute
        # reached this point (nothing is queued on compute between here and the allocations below).
        acc.wait_event(acc.record_event(), stream=self.stream)
        batch = map_tensors(self._copy_to_device, host)
        return True, batch, acc.record_event(self.stream)

    def _copy_to_device(self, t: torch.Tensor) -> torch.Tensor:
        moved = self.acc.empty(tuple(t.shape), t.dtype)  # on the compute stream
        # Asynchronous only from pinned memory: from pageable memory the copy is synchronous.
        self.acc.copy_(moved, t, stream=self.stream)
        return moved

    def _stream_batches(self) -> Iterator[Any]:
        acc = self.acc
        batches = iter(self.loader)
        ready, upcoming, copied = self._copy_next(batches)
        while ready:
            acc.wait_event(copied)  # compute must not read the batch before its copy has landed
            batch = upcoming
            ready, upcoming, copied = self._copy_next(batches)  # queued now, so it runs during this batch's compute
            yield batch


def _streams_of(device: torch.device) -> Accelerator | None:
    """The seam of ``device`` where it has streams (a GPU; the CPU under simulation), else None."""
    if device.type == "meta":
        return None
    acc = accelerator(device)
    return acc if acc.has_streams else None
