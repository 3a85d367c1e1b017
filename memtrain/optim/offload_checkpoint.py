"""CPUOffloadOptimizer's checkpoints: the host state in torch's format, keyed by parameter name.

A state_dict of this class loads into a plain ``optimizer_class`` over the same parameters and back; with non-fp32
device weights each entry also holds the fp32 master, so a resumed run continues bit-identically.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memtrain.errors import ConfigError
from memtrain.optim.host_buffers import IMPLEMENTATION_KEYS, STATE_BYTES_PER_PARAM, Bucket, Slot
from memtrain.optim.moments import adopt_entry, entry_for, moments_of, precision_of
from memtrain.techniques.optimizer import NamedOptimizer


class OffloadCheckpoint:
    """CPUOffloadOptimizer's ``state_dict`` and ``load_state_dict`` (a mixin: the attributes it reads are set up
    by ``CPUOffloadOptimizer.__init__``)."""

    if TYPE_CHECKING:
        param_groups: list[dict[str, Any]]
        state: Any
        _slots: list[Slot]
        state_precision: str
        _buckets: list[Bucket]

        def synchronize(self) -> None: ...

        def _link_state(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """The host state, in torch's format, keyed by parameter name (by index without names).

        Loadable by a plain ``optimizer_class`` over the same parameters (``torch.optim.AdamW(model.parameters())
        .load_state_dict(...)``). Tensors are copies (the live ones are views of shared flat buffers, which
        safetensors refuses and torch.save would write whole). With non-fp32 device weights each entry also
        holds ``master_weight``, the fp32 master, so a resumed run continues bit-identically.
        """
        self.synchronize()
        state: dict[int | str, dict[str, Any]] = {}
        groups = []
        for gi, group in enumerate(self.param_groups):
            slots = [s for s in self._slots if s.group == gi]
            saved = {k: v for k, v in group.items() if k != "params"}
            # torch's load_state_dict replaces a group with the saved one: keep our kernel choice in it as torch
            # itself would, or a plain optimizer loading this would silently fall back to its slowest kernel.
            saved.update({k: v for k, v in self._buckets[0].inner.defaults.items() if k in IMPLEMENTATION_KEYS})
            saved["params"] = [s.key for s in slots]
            groups.append(saved)
            for slot in slots:
                entry = self.state.get(slot.device)
                if entry:
                    state[slot.key] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                    if slot.device.dtype != slot.master.dtype:  # pure bf16: the master is the weight
                        state[slot.key]["master_weight"] = slot.master.clone()
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of a plain ``optimizer_class`` (e.g. a device AdamW's).

        Entries are matched by parameter name when both sides have names (``param_names``), else by position.
        The fp32 masters are re-read from the device parameters (or from ``master_weight``), so load the model's
        weights first.
        """
        self.synchronize()
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ConfigError(f"the state_dict has parameter groups of sizes {saved_sizes}, this optimizer "
                              f"{sizes}. To resolve this error, build the optimizer over the same parameters.")
        by_key = self._match_keys(saved_groups)
        problems = []
        # AdamW's (and SGD's) state is parameter-shaped; another class's may not be (Adafactor's row and column
        # vectors): it is loaded as saved.
        shaped = type(self._buckets[0].inner) in STATE_BYTES_PER_PARAM or self.state_precision != "fp32"
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
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names", *IMPLEMENTATION_KEYS)})
        for bucket in self._buckets:
            bucket.inner.state.clear()
        fp32_state = type(self._buckets[0].inner) in STATE_BYTES_PER_PARAM
        index = {id(slot): i for i, slot in enumerate(self._slots)}  # salts the bf16 rounding of converted moments
        for slot in self._slots:
            slot.master.copy_(slot.device.detach())
        for key, entry in state_dict["state"].items():
            slot = by_key[key]
            owner = next(b for b in self._buckets if slot in b.slots)
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
        self._link_state()

    def _named_state_bytes(self, slot: Slot) -> int:
        """A class memtrain has no figure for: its state's bytes for ``slot``'s master, measured by its probe."""
        inner = self._buckets[slot.bucket].inner
        kwargs = {k: v for k, v in inner.defaults.items() if k not in ("lr", *IMPLEMENTATION_KEYS)}
        return NamedOptimizer.of(type(inner), kwargs).state_bytes(tuple(slot.master.shape), slot.master.dtype)

    def _match_keys(self, saved_groups: list[dict[str, Any]]) -> dict[Any, Slot]:
        saved_keys = [k for g in saved_groups for k in g["params"]]
        ours = [s for gi in range(len(self.param_groups)) for s in self._slots if s.group == gi]
        saved_names = [n for g in saved_groups for n in g.get("param_names", [])]
        if len(saved_names) == len(saved_keys) and all(isinstance(s.key, str) for s in ours):
            by_name = {s.key: s for s in ours}
            missing = sorted(set(saved_names) - set(by_name))
            if missing:
                raise ConfigError(f"the state_dict names parameters this optimizer does not have: {missing[:5]}. "
                                  "To resolve this error, build the optimizer over the same named parameters.")
            return {k: by_name[n] for k, n in zip(saved_keys, saved_names, strict=True)}
        return dict(zip(saved_keys, ours, strict=True))
