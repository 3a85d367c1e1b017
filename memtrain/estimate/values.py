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

MAX_KNOWN_ELEMENTS = 1 << 17  # larger constants (a (T, T) mask past T = 362) are left unknown: memory and time
_READ = torch.ops.aten._local_scalar_dense.default
_VALUE = "_memtrain_known_value"  # the attribute of a stand-in that holds its real value (dies with it)


def _real_device(x: Any) -> Any:
    return torch.device("cpu") if isinstance(x, (torch.device, str)) and str(x) in ("meta", "cuda") else x


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an op's arguments (one level of lists, as aten's schemas have)."""
    found = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found.extend(y for y in x if isinstance(y, torch.Tensor))
    return found


def value(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s real value: kept beside it, or ``t`` itself when it holds data (a constant lifted into the trace)."""
    real = getattr(t, _VALUE, None)
    if real is not None:
        return real
    return t if t.device.type != "meta" and not is_fake(t) else None


class KnownValues:
    """Follows the traced step's ops, keeping the real value of each tensor computed from constants alone."""

    def read(self, func: Any, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """(True, the value) when ``func`` reads a tensor's value and it is known; (False, None) otherwise."""
        real = value(args[0]) if func is _READ else None
        if real is None:
            return False, None
        with unset_fake_temporarily():
            return True, real.item()

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Computes ``func``'s real result when every tensor it reads is known (a factory of constants reads none),
        and keeps it beside ``out``; a tensor written in place from something unknown becomes unknown."""
        tensors = _tensors(args, kwargs)
        # Most ops read a tensor of the batch or the weights: unknown, and decided before anything else is looked at.
        unknown = any(value(t) is None for t in tensors)
        outs = [] if unknown else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if (unknown or not outs or torch.Tag.nondeterministic_seeded in func.tags
                or func.overloadpacket.__name__.startswith("empty") or func is _READ
                or any(t.numel() > MAX_KNOWN_ELEMENTS for t in (*tensors, *outs))):
            if func._schema.is_mutable:
                for t in tensors:  # written in place (perhaps) from something unknown
                    if getattr(t, _VALUE, None) is not None:
                        setattr(t, _VALUE, None)
            return
        real_args, real_kwargs = tree_map(
            lambda x: value(x) if isinstance(x, torch.Tensor) else _real_device(x), (args, kwargs))
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        for stand_in, real in zip(tree_flatten(out)[0], tree_flatten(real_out)[0], strict=False):
            if isinstance(stand_in, torch.Tensor) and isinstance(real, torch.Tensor) and stand_in is not real:
                setattr(stand_in, _VALUE, real)
