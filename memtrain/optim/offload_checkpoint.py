"""CPUOffloadOptimizer's checkpoints: the host state in torch's format, keyed by parameter name.

A state_dict of this class loads into a plain ``optimizer_class`` over the same parameters and back; with non-fp32
device weights each entry also holds the fp32 master, so a resumed run continues bit-identically.
"""

from __future__ import annotations

from typing import Any

import torch

from memtrain.errors import ConfigError
from memtrain.optim.host_buffers import IMPLEMENTATION_KEYS, STATE_BYTES_PER_PARAM, Bucket, Slot
from memtrain.optim.moments import adopt_entry, entry_for, moments_of, precision_of
from memtrain.techniques.optimizer import NamedOptimizer


class OffloadCheckpoint:
    """Converts one CPUOffloadOptimizer's host state to and from torch's format. The offloader finishes any pending
    update first and links its ``state`` to the host state again after a load.

    Args:
        slots: the offloader's slots, in param_groups order.
        buckets: its buckets, whose wrapped optimizers hold the host state.
        state_precision: the moments' precision on the host ("fp32", "bf16" or "int8").
        salt_start: the offloader's first rounding salt: converted bf16 moments are salted from it in param_groups
            order, as a fresh step salts them (``host_buffers.make_buckets``).
    """

    def __init__(self, slots: list[Slot], buckets: list[Bucket], state_precision: str, *, salt_start: int = 0):
        self.slots, self.buckets, self.state_precision = slots, buckets, state_precision
        self.salt_start = salt_start

    # The outer param_groups and state are passed at each call: torch's Optimizer owns them (and may rebind them).
    def state_dict(self, param_groups: list[dict[str, Any]], outer_state: Any) -> dict[str, Any]:
        """The host state, in torch's format, keyed by parameter name (by index without names); see
        ``CPUOffloadOptimizer.state_dict``."""
        state: dict[int | str, dict[str, Any]] = {}
        groups = []
        for gi, group in enumerate(param_groups):
            slots = [s for s in self.slots if s.group == gi]
            saved = {k: v for k, v in group.items() if k != "params"}
            # torch's load_state_dict replaces a group with the saved one: keep our kernel choice in it as torch
            # itself would, or a plain optimizer loading this would silently fall back to its slowest kernel.
            saved.update({k: v for k, v in self.buckets[0].inner.defaults.items() if k in IMPLEMENTATION_KEYS})
            saved["params"] = [s.key for s in slots]
            groups.append(saved)
            for slot in slots:
                entry = outer_state.get(slot.device)
                if entry:
                    state[slot.key] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                    if slot.device.dtype != slot.master.dtype:  # pure bf16: the master is the weight
                        state[slot.key]["master_weight"] = slot.master.clone()
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """Loads a state_dict of CPUOffloadOptimizer or of a plain ``optimizer_class`` into the host state and
        ``param_groups``' hyper-parameters; see ``CPUOffloadOptimizer.load_state_dict``."""
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in param_groups]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ConfigError(f"the state_dict has parameter groups of sizes {saved_sizes}, this optimizer "
                              f"{sizes}. To resolve this error, build the optimizer over the same parameters.")
        by_key = self._match_keys(saved_groups, len(param_groups))
        problems = []
        # AdamW's (and SGD's) state is parameter-shaped; another class's may not be (Adafactor's row and column
        # vectors): it is loaded as saved.
        shaped = type(self.buckets[0].inner) in STATE_BYTES_PER_PARAM or self.state_precision != "fp32"
        for key, entry in state_dict["state"].items():
            slot = by_key.get(key)
            if slot is None:
                problems.append(f"state entry {key!r} belongs to no parameter of the state_dict's param_groups.")
                continue
            if not shaped:  # another class: its entry's bytes against its probe's for this parameter
                saved = sum(v.numel() * v.element_size() for k, v in entry.items()
                            if isinstance(v, torch.Tensor) and k != "master_weight")
                expected = self._named_state_bytes(slot)
                if saved != expected:
                    problems.append(f"state of {key!r} holds {saved:,} bytes, a {tuple(slot.master.shape)} "
                                    f"parameter's {expected:,}.")
                continue
            # 8-bit entries also hold their code books and block scales, which are not parameter-shaped.
            shapes = {k: tuple(v.shape) for k, v in entry.items() if isinstance(v, torch.Tensor) and v.ndim > 0
                      and not k.startswith(("qmap", "absmax"))}
            wrong = {k: shape for k, shape in shapes.items() if shape != tuple(slot.master.shape)}
            if wrong:
                problems.append(f"state of {key!r} has shapes {wrong}, the parameter {tuple(slot.master.shape)}.")
        if problems:
            problems[-1] += " To resolve this error, load a state_dict saved for the same model and parameter order."
        ConfigError.raise_if(problems)
        for group, saved in zip(param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names", *IMPLEMENTATION_KEYS)})
        for bucket in self.buckets:
            bucket.inner.state.clear()
        fp32_state = type(self.buckets[0].inner) in STATE_BYTES_PER_PARAM
        # Salts the bf16 rounding of converted moments, as a fresh step's (host_buffers.make_buckets).
        index = {id(slot): self.salt_start + i for i, slot in enumerate(self.slots)}
        for slot in self.slots:
            slot.master.copy_(slot.device.detach())
        for key, entry in state_dict["state"].items():
            slot = by_key[key]
            owner = next(b for b in self.buckets if slot in b.slots)
            entry = dict(entry)
            master = entry.pop("master_weight", None)
            if master is not None:
                slot.master.copy_(master)
            if self.state_precision != "fp32" or precision_of(entry) != "fp32":
                # AdamW moments of a precision: the same one loads as it is (bit-identical resume: bf16 rounding
                # counters and 8-bit codes kept), another is converted (cast, or block-wise (de)quantised).
                same = precision_of(entry) == self.state_precision
                owner.inner.state[slot.master] = (
                    adopt_entry(owner.inner, slot.master, entry) if same else
                    entry_for(owner.inner, slot.master, moments_of(entry), salt=index[id(slot)]))
                continue
            # The host kernels need CPU tensors, fp32 for torch's own optimizers (a fused/capturable device optimizer
            # keeps "step" on the GPU); other classes keep their state's dtypes (bf16 moments, 8-bit codes).
            owner.inner.state[slot.master] = {
                k: (v.detach().to("cpu", torch.float32 if fp32_state else v.dtype, copy=True)
                    if isinstance(v, torch.Tensor) else v)
                for k, v in entry.items()
            }

    @torch.no_grad()
    def load_entries(self, same: dict[str, dict[str, Any]], converted: dict[str, tuple[Any, ...]],
                     masters: dict[str, torch.Tensor]) -> None:
        """Loads AdamW state by parameter name, checked by the caller (``ComposedOptimizer.load_state_dict``): the
        entries of ``same`` (in this precision) as they are, the moments of ``converted`` (``moments_of``'s
        step, m, v) converted to this precision, their bf16 rounding salted from ``salt_start`` in param_groups
        order (as a fresh step's); each master re-read from its device parameter, or taken from ``masters``."""
        for bucket in self.buckets:
            bucket.inner.state.clear()
        for slot in self.slots:
            slot.master.copy_(slot.device.detach())
        for i, slot in enumerate(self.slots):
            name = slot.key
            if name in masters:
                slot.master.copy_(masters[name])
            inner = self.buckets[slot.bucket].inner
            if name in same:
                inner.state[slot.master] = adopt_entry(inner, slot.master, same[name])
            elif name in converted:
                inner.state[slot.master] = entry_for(inner, slot.master, converted[name], salt=self.salt_start + i)

    def _named_state_bytes(self, slot: Slot) -> int:
        """A class memtrain has no figure for: its state's bytes for ``slot``'s master, measured by its probe."""
        inner = self.buckets[slot.bucket].inner
        kwargs = {k: v for k, v in inner.defaults.items() if k not in ("lr", *IMPLEMENTATION_KEYS)}
        return NamedOptimizer.of(type(inner), kwargs).state_bytes(tuple(slot.master.shape), slot.master.dtype)

    def _match_keys(self, saved_groups: list[dict[str, Any]], n_groups: int) -> dict[Any, Slot]:
        saved_keys = [k for g in saved_groups for k in g["params"]]
        ours = [s for gi in range(n_groups) for s in self.slots if s.group == gi]
        saved_names = [n for g in saved_groups for n in g.get("param_names", [])]
        if len(saved_names) == len(saved_keys) and all(isinstance(s.key, str) for s in ours):
            by_name = {s.key: s for s in ours}
            missing = sorted(set(saved_names) - set(by_name))
            if missing:
                raise ConfigError(f"the state_dict names parameters this optimizer does not have: {missing[:5]}. "
                                  "To resolve this error, build the optimizer over the same named parameters.")
            return {k: by_name[n] for k, n in zip(saved_keys, saved_names, strict=True)}
        return dict(zip(saved_keys, ours, strict=True))
