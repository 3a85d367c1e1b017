"""Activation offload simulated on tensors without data: what ``ActivationOffloader`` moves to the host in forward,
what comes back in backward and when (two records prefetched ahead), so the device's bytes are exact.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain.checkpointing import CheckpointedForward
from memtrain.estimate.attribution import BlockMeter
from memtrain.measure import MemoryMeter
from memtrain.offload import derived_from_leaf


# -- activation offload, simulated --------------------------------------------------------------------------
@dataclass(eq=False)
class _HostRecord:
    index: int  # in the order of saving
    nbytes: int  # the whole storage: what crosses the link, and what comes back
    device: torch.device
    packs: int = 0
    unpacks: int = 0
    restored: torch.Tensor | None = None  # the storage back on the device (uint8), while backward needs it


class SimulatedOffload:
    """The device memory of ``ActivationOffloader`` on tensors without data.

    A saved tensor the offloader would move (at least ``min_bytes``, not a parameter, a buffer or a cast or view
    of one, not saved by the head) leaves the device in forward: nothing keeps a reference to it, so its storage
    dies with its last other user. In backward its whole storage comes back (views of one storage share it),
    ``prefetch_depth`` records ahead of use, and is let go once its last user has unpacked it. Re-entrant, as the
    offloader is (every offloaded block enters the same one). The meter still counts every saved tensor.
    """

    def __init__(self, meter: MemoryMeter, state_storages: set[int], *, min_bytes: int, prefetch_depth: int = 2,
                 frozen_shapes: frozenset[tuple[int, ...]] = frozenset()):
        self.meter = meter
        self.state_storages = state_storages
        self.frozen_shapes = frozen_shapes  # the shapes of frozen parameters: their autocast casts stay too
        self.min_bytes = min_bytes
        self.prefetch_depth = prefetch_depth
        self.records: list[_HostRecord] = []
        self._by_storage: dict[int, tuple[weakref.ref, _HostRecord]] = {}
        self._hooks: list[Any] = []
        self.in_tail = False  # the head has started: logits and the loss stay on the device

    @property
    def host_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def __enter__(self) -> SimulatedOffload:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.pop().__exit__(*exc)

    def _keeps(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()
        if t.layout != torch.strided or storage.nbytes() < self.min_bytes or self.in_tail:
            return True
        if isinstance(t, nn.Parameter) or storage._cdata in self.state_storages:
            return True
        # The offloader's own rules (ActivationOffloader._keep_reason): parameters' views, casts and copies stay.
        base = t if t._base is None else t._base
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad) or derived_from_leaf(t):
            return True
        return (base.grad_fn is None and not base.requires_grad and base.is_floating_point()
                and tuple(base.shape) in self.frozen_shapes)

    def _pack(self, t: torch.Tensor) -> Any:
        self.meter._count(t)  # saved-tensor hooks do not stack: the meter's own would not see this tensor
        if self._keeps(t):
            return t
        storage = t.untyped_storage()
        entry = self._by_storage.get(storage._cdata)
        if entry is None or entry[0]() is not storage:  # a storage address reused after a free is another tensor
            entry = (weakref.ref(storage), _HostRecord(len(self.records), storage.nbytes(), t.device))
            self._by_storage[storage._cdata] = entry
            self.records.append(entry[1])
            run = self.meter.tracker.run_here() if isinstance(self.meter, BlockMeter) else None
            if run is not None:
                run.offloaded_bytes += entry[1].nbytes
                run.offloaded_sizes.append(entry[1].nbytes)
        record = entry[1]
        record.packs += 1
        return record, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype

    def _restore(self, record: _HostRecord) -> None:
        if record.restored is None and record.unpacks < record.packs:
            record.restored = torch.empty(record.nbytes, dtype=torch.uint8, device=record.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        record, shape, stride, offset, dtype = packed
        self._restore(record)
        for earlier in reversed(self.records[max(0, record.index - self.prefetch_depth):record.index]):
            self._restore(earlier)  # prefetched: backward uses records in about the reverse order of saving
        restored = record.restored
        assert restored is not None
        record.unpacks += 1
        if record.unpacks >= record.packs:
            record.restored = None  # the offloader lets go; autograd's reference keeps it while it is used
        return torch.empty((0,), dtype=dtype, device=restored.device).set_(restored.untyped_storage(), offset, shape,
                                                                          stride)

    def end_of_backward(self) -> None:
        for record in self.records:
            record.restored = None


def simulate_offload(model: nn.Module, offload: SimulatedOffload) -> int:
    """Points every wrapped block that offloads (its saved inputs, or all it saves) at ``offload``; returns how
    many do."""
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward) and (forward.spec.offloader is not None
                                                          or forward.spec.policy == "offload"):
            forward.spec = dataclasses.replace(forward.spec, offloader=offload)  # type: ignore[arg-type]
            count += 1
    return count
