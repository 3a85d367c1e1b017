"""Selective checkpointing: the op-level policy that keeps some ops' outputs and recomputes the rest of a block.

Ops that draw random numbers (dropout, the fused attention kernels with dropout) are always recomputed, never kept,
so the recompute draws what forward drew.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memtrain.measure import metering, note_saved

OpKind = Literal["matmul", "attention", "conv"]

_OP_NAMES: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"),
    "attention": (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ),
    "conv": ("convolution", "cudnn_convolution", "mkldnn_convolution", "_convolution"),
}


def op_packets(kinds: Sequence[str]) -> frozenset[Any]:
    return frozenset(
        getattr(torch.ops.aten, name) for kind in kinds for name in _OP_NAMES[kind] if hasattr(torch.ops.aten, name)
    )


@dataclass(frozen=True)
class SelectivePolicy:
    """Keeps the outputs of some op kinds in forward and recomputes the rest of the block in backward.

    Saving matmul and attention outputs skips the expensive part of the recompute (the FLOPs) and drops the bytes
    of the rest (pointwise ops, norms, activation functions). It pays when those intermediates dominate a block's
    saved bytes and kernels are large enough to hide torch's per-op dispatch cost in the recompute (about 25 us an
    op). On Llama-style blocks the kept matmul outputs (q/k/v/o, gate/up/down) are most of the bytes: there it saved
    1.66x at 1.05x step time against 1.8x at 1.11x for ``every=2`` (one CPU run of ``memtrain bench checkpointing``,
    table in benchmarks/README.md), so ``every=k`` is the better middle ground when memory is what is short.

    Args:
        keep: op kinds whose outputs are kept: "matmul" (mm, addmm, bmm), "attention" (the fused SDPA kernels),
            "conv" (convolutions).
    """

    keep: tuple[OpKind, ...] = ("matmul", "attention")

    def context_fn(self) -> tuple[Any, Any]:
        """The ``context_fn`` of ``torch.utils.checkpoint`` (two dispatch modes) for this policy."""
        return selective_contexts(tuple(self.keep))()


@functools.cache
def selective_contexts(keep: tuple[str, ...]) -> Callable[[], tuple[Any, Any]]:
    """Checkpoint's ``context_fn`` for ``keep``: a ``functools.partial`` (the form torch.compile traces); cached, so
    every block and step passes the same object (no recompiles)."""
    return functools.partial(_selective_modes, op_packets(keep))


def _selective_modes(ops: frozenset[Any]) -> tuple[Any, Any]:
    """torch's two dispatch modes for the policy keeping ``ops``, the forward one reporting what it keeps.

    Kept outputs live in checkpoint's cache, not in autograd's saved tensors, so the meter hears of them here.
    They are counted after each op has run, in the forward mode: torch 2.13's policy sees the output
    (``SelectiveCheckpointContext.op_output``), torch 2.11's runs before the op and never does.
    """
    caching, cached = create_selective_checkpoint_contexts(functools.partial(keep_policy, ops))
    caching.__class__ = _counting_mode(type(caching))  # NOTE: a subclass adding one step; its state is torch's
    caching._memtrain_ops = ops
    return caching, cached


@functools.cache
def _counting_mode(base: type) -> type:
    class _KeptOutputsCounted(base):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            # A compiled graph saves kept outputs as ordinary saved tensors, which the meter sees anyway.
            if metering() and not _tracing() and _keeps(self._memtrain_ops, func, args, kwargs or {}):
                note_saved(out)
            return out

    return _KeptOutputsCounted


def _tracing() -> bool:
    """Whether a compiler traces the ops (dynamo, or AOTAutograd's proxy mode): their outputs are fake then."""
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(
        torch._C._TorchDispatchModeKey.PROXY) is not None


_NO_ARGUMENT = object()


def _argument(op: Any, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The value ``op`` gets for its schema argument ``name`` (its default when not passed), or _NO_ARGUMENT."""
    schema = getattr(op, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            if i < len(args) and not argument.kwarg_only:
                return args[i]
            return argument.default_value
    return _NO_ARGUMENT


def _consumes_rng(op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``op`` draws from the random generator: dropout, bernoulli, and the fused attention kernels when
    their ``dropout_p`` is not 0 (their outputs then include the Philox seed and offset they used).

    torch tags every such op ``nondeterministic_seeded``, attention kernels whatever their ``dropout_p``.
    """
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    p = _argument(op, "dropout_p", args, kwargs)
    return p is _NO_ARGUMENT or p is None or p != 0


def _keeps(ops: frozenset[Any], op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    # A tiled MLP keeps its input and recomputes its tiles itself: keeping its matmuls would hold the whole
    # intermediate it exists not to hold (it runs again whole in the block's recompute, keeping its input again).
    return (getattr(op, "overloadpacket", None) in ops and not _consumes_rng(op, args, kwargs)
            and not getattr(_region, "keeping_nothing", 0))


_region = threading.local()


@contextlib.contextmanager
def keeping_nothing() -> Iterator[None]:
    """A stretch of forward whose outputs a selective checkpoint keeps none of, whatever its policy: code that keeps
    what it needs itself and recomputes the rest (the tiled MLP, ``memtrain.tiled_mlp``)."""
    _region.keeping_nothing = getattr(_region, "keeping_nothing", 0) + 1
    try:
        yield
    finally:
        _region.keeping_nothing -= 1


def keep_policy(ops: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if _consumes_rng(op, args, kwargs):
        # Recomputed, never kept: checkpoint restores the RNG state before the recompute, which then draws what
        # forward drew only if every op that drew in forward draws again, in order. A kept fused attention kernel
        # would skip its Philox offsets, and every dropout after it in the block would get another mask.
        return CheckpointPolicy.MUST_RECOMPUTE
    if _keeps(ops, op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def resolve_selective(selective: SelectivePolicy | Sequence[str] | None, problems: list[str]) -> SelectivePolicy | None:
    if selective is None or isinstance(selective, SelectivePolicy):
        policy = selective
    elif isinstance(selective, Sequence) and not isinstance(selective, (str, bytes)):
        policy = SelectivePolicy(keep=tuple(selective))
    elif isinstance(selective, str):
        policy = SelectivePolicy(keep=(selective,))  # type: ignore[arg-type]
    else:
        problems.append(
            f"selective={selective!r} is not a policy. To resolve this error, pass op kinds to keep, e.g. "
            "selective=('matmul', 'attention'), or a SelectivePolicy."
        )
        return None
    if policy is not None:
        known = get_args(OpKind)
        unknown = [k for k in policy.keep if k not in known]
        if unknown or not policy.keep:
            problems.append(
                f"selective: unknown op kinds {unknown or list(policy.keep)}; known kinds are {list(known)}. "
                "To resolve this error, keep a non-empty subset of those, e.g. ('matmul', 'attention')."
            )
    return policy
