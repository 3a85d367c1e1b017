"""Values a traced step can know without data: tensors computed from constants alone (``torch.ones``,
``torch.arange``, their masks and sums), kept beside their fake or meta stand-ins, so that a module that reads one
(``.item()``, ``bool(t)``, ``.tolist()``) gets the value the real run reads.

A model's code reads such values to choose a branch (transformers' decoders check that an all-ones padding mask is
all ones before passing ``is_causal=True``): with the real value the trace takes the real run's branch, and the
estimate stays exact. A value computed from the weights or the batch (an MoE router's token counts) is unknown:
reading it stops the trace, and the forward's error names the module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

MAX_KNOWN_ELEMENTS = 1 << 20  # larger constants (a (B, 1, T, T) mask at long T) are left unknown: memory and time
_READ = torch.ops.aten._local_scalar_dense.default


def _real_device(x: Any) -> Any:
    return torch.device("cpu") if isinstance(x, (torch.device, str)) and str(x) in ("meta", "cuda") else x


class KnownValues:
    """The real values of the traced step's constant tensors, by stand-in (weakly: they die with it)."""

    def __init__(self) -> None:
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s real value: kept beside it, or ``t`` itself when it holds data (a constant lifted into the trace)."""
        if t in self.values:
            return self.values[t]
        return t if t.device.type != "meta" and not is_fake(t) else None

    def read(self, func: Any, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """(True, the value) when ``func`` reads a tensor's value and it is known; (False, None) otherwise."""
        real = self.value(args[0]) if func is _READ else None
        if real is None:
            return False, None
        with unset_fake_temporarily():
            return True, real.item()

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Computes ``func``'s real result when every tensor it reads is known (a factory of constants reads none),
        and keeps it beside ``out``; a tensor written in place from something unknown becomes unknown."""
        flat, _ = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        known = all(self.value(t) is not None for t in tensors)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if (not known or not outs or torch.Tag.nondeterministic_seeded in func.tags
                or func.overloadpacket.__name__.startswith("empty") or func is _READ
                or any(t.numel() > MAX_KNOWN_ELEMENTS for t in (*tensors, *outs))):
            if func._schema.is_mutable:
                for t in tensors:  # written in place (perhaps) from something unknown
                    self.values.pop(t, None)
            return
        real_args, real_kwargs = tree_map(
            lambda x: self.value(x) if isinstance(x, torch.Tensor) else _real_device(x), (args, kwargs))
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        real_flat, _ = tree_flatten(real_out)
        for stand_in, real in zip(tree_flatten(out)[0], real_flat, strict=False):
            if isinstance(stand_in, torch.Tensor) and isinstance(real, torch.Tensor):
                self.values[stand_in] = real

