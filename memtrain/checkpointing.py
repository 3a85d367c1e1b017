"""Activation checkpointing: recompute each block in backward instead of keeping its activations.

A checkpointed block keeps only its inputs during forward and runs its forward again in backward: about one
extra forward pass of time, for all of the block's internal activations. Built on torch's non-reentrant
``torch.utils.checkpoint`` and made exact:

- dropout masks in the recompute equal the forward's (the RNG state is restored);
- BatchNorm running statistics and ``num_batches_tracked`` are updated once per forward, not again in the
  recompute (torch leaves this open: pytorch issue 96136);
- keyword arguments, non-tensor arguments and tuple/dict outputs pass through; gradients flow when no input
  requires grad (frozen embeddings, PEFT-style frozen layers).

Blocks are wrapped in place by replacing the block's ``forward`` on the instance, so parameter names, state
dicts and ``isinstance`` checks are unchanged.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memtrain.errors import ConfigError
from memtrain.measure import metering, note_saved
from memtrain.offload import ActivationOffloader, offload_activations

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


def _op_packets(kinds: Sequence[str]) -> frozenset[Any]:
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
        return _selective_contexts(tuple(self.keep))()


@functools.cache
def _selective_contexts(keep: tuple[str, ...]) -> Callable[[], tuple[Any, Any]]:
    """Checkpoint's ``context_fn`` for ``keep``: a ``functools.partial`` (the form torch.compile traces); cached, so
    every block and step passes the same object (no recompiles)."""
    return functools.partial(_selective_modes, _op_packets(keep))


def _selective_modes(ops: frozenset[Any]) -> tuple[Any, Any]:
    """torch's two dispatch modes for the policy keeping ``ops``, the forward one reporting what it keeps.

    Kept outputs live in checkpoint's cache, not in autograd's saved tensors, so the meter hears of them here.
    They are counted after each op has run, in the forward mode: torch 2.13's policy sees the output
    (``SelectiveCheckpointContext.op_output``), torch 2.11's runs before the op and never does.
    """
    caching, cached = create_selective_checkpoint_contexts(functools.partial(_keep_policy, ops))
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
    return getattr(op, "overloadpacket", None) in ops and not _consumes_rng(op, args, kwargs)


def _keep_policy(ops: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if _consumes_rng(op, args, kwargs):
        # Recomputed, never kept: checkpoint restores the RNG state before the recompute, which then draws what
        # forward drew only if every op that drew in forward draws again, in order. A kept fused attention kernel
        # would skip its Philox offsets, and every dropout after it in the block would get another mask.
        return CheckpointPolicy.MUST_RECOMPUTE
    if _keeps(ops, op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


BlockPolicy = Literal["keep", "recompute", "offload"]


@dataclass(frozen=True)
class CheckpointSpec:
    """What one wrapped block does: recompute it in backward (keeping the ops ``selective`` names), or, with
    ``policy="offload"``, no recompute and every activation it saves in host memory. With an ``offloader``, a
    recomputed block's saved inputs wait in host memory too."""

    selective: SelectivePolicy | None = None
    policy: Literal["recompute", "offload"] = "recompute"
    offloader: ActivationOffloader | None = field(default=None, compare=False, repr=False)

    @property
    def checkpoint_kwargs(self) -> dict[str, Any]:
        """Extra arguments of ``torch.utils.checkpoint``: torch's default ``context_fn`` unless selective (under
        torch.compile only a dispatch-mode pair, built by a ``functools.partial`` of torch's function, traces)."""
        return {"context_fn": _selective_contexts(tuple(self.selective.keep))} if self.selective is not None else {}


BlockSelector = None | type | tuple[type, ...] | Callable[[str, nn.Module], bool] | Sequence[str]

_WRAPPED_ATTR = "_memtrain_checkpoint"
_USE_CACHE_ATTR = "_memtrain_use_cache"


# -- the checkpointed call ----------------------------------------------------------------------------------
def _running_stat_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]


@contextlib.contextmanager
def _running_stats_frozen(norms: Sequence[nn.Module]) -> Iterator[None]:
    """Restores BatchNorm running statistics after a recompute, so they are updated once per forward."""
    saved = [
        (buf, buf.detach().clone())
        for m in norms
        if m.training
        for buf in (m.running_mean, m.running_var, m.num_batches_tracked)
        if buf is not None
    ]
    try:
        yield
    finally:
        for buf, value in saved:
            # NOTE: through .data, so the version counter of a buffer autograd saved is left alone.
            buf.data.copy_(value)


def _checkpointed_call(
    fn: Callable[..., Any], spec: CheckpointSpec, checkpoint_kwargs: dict[str, Any], norms: Sequence[nn.Module],
    *args: Any, **kwargs: Any
) -> Any:
    """A wrapped block's call without its offloader: what a compiled region may hold (``compile_model``)."""
    if spec.policy == "offload" or not torch.is_grad_enabled():
        # Offload instead of recompute: every tensor the block saves goes through the offloader's hooks, which
        # the caller has entered.
        return fn(*args, **kwargs)
    run = fn
    # Only eager blocks with running statistics pay for this bookkeeping: torch.compile cannot trace a
    # checkpointed function that changes state outside itself (it would run the model eagerly), and needs none:
    # its graph updates the buffers once, in forward, and the recompute does not replay that update.
    if norms and not torch.compiler.is_compiling():
        first_call = True

        def run(*a: Any, **kw: Any) -> Any:
            nonlocal first_call
            if first_call:
                first_call = False
                return fn(*a, **kw)
            with _running_stats_frozen(norms):
                return fn(*a, **kw)

    run, args, kwargs = _keyword_tensors_positional(run, args, kwargs)
    # Non-reentrant checkpoint saves the block inputs through the outer saved-tensor hooks (the block's own
    # activations go through its inner ones), so an offloader entered around this call moves exactly the inputs.
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **checkpoint_kwargs, **kwargs)


def _keyword_tensors_positional(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``fn`` and arguments for ``checkpoint``: every tensor among ``kwargs`` (nested ones too) appended to the
    positional arguments, and a closure that rebuilds the keywords (``kwargs`` as they are when none holds one).

    torch stashes the device RNG state (CUDA dropout masks) only for the devices of tensors among checkpoint's
    positional arguments, and saves only those through the saved-tensor hooks: a block called as
    ``layer(hidden_states=h)`` would recompute other dropout masks on a GPU and keep its input out of an
    offloader's reach.
    """
    leaves, spec = tree_flatten(kwargs)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not at:
        return fn, args, kwargs
    # The closure keeps the non-tensor leaves only: holding the tensors would pin them on the device.
    template = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    n = len(args)

    def call(*flat: Any) -> Any:
        values = list(template)
        for i, tensor in zip(at, flat[n:], strict=True):
            values[i] = tensor
        return fn(*flat[:n], **tree_unflatten(values, spec))

    return call, (*args, *(leaves[i] for i in at)), {}


class _CheckpointedForward:
    """The instance-level ``forward`` of a wrapped block."""

    def __init__(self, module: nn.Module, original: Callable[..., Any], had_instance_forward: bool,
                 spec: CheckpointSpec):
        self.original = original
        self.had_instance_forward = had_instance_forward
        self.spec = spec
        self.norms = _running_stat_modules(module)
        self.checkpoint_kwargs = spec.checkpoint_kwargs  # built here, outside any compiled region
        self.compiled: Callable[..., Any] | None = None  # the call within the offloader, compiled (compile_model)
        self.__wrapped__ = original  # inspect.signature(module.forward) still shows the block's own arguments

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The offloader this block enters, when it moves tensors (a disabled one, without CUDA, does nothing;
        the estimator's simulated one is always entered)."""
        offloader = self.spec.offloader
        return offloader if offloader is not None and getattr(offloader, "enabled", True) else None

    def __getstate__(self) -> dict[str, Any]:  # torch.save(model): op packets cannot be pickled; rebuilt on load
        return {k: v for k, v in self.__dict__.items() if k not in ("checkpoint_kwargs", "compiled")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.checkpoint_kwargs = self.spec.checkpoint_kwargs
        self.compiled = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        offloader = self.offloader
        if offloader is None:  # nothing dynamo cannot trace: a compiled model takes the block into its graph
            return _checkpointed_call(self.original, self.spec, self.checkpoint_kwargs, self.norms, *args, **kwargs)
        # Saved-tensor hooks cannot be traced (dynamo breaks the graph at them, and skips the model's whole forward
        # when that happens in its loop over blocks): they stay outside, around this block's compiled region.
        call = self.compiled
        if call is None:
            if _in_compiled_region():
                raise ConfigError(
                    "torch.compile(model) cannot trace the activation offloader of a block memtrain offloads "
                    "(saved-tensor hooks): dynamo would break the graph there and run the model's forward eagerly. "
                    "To resolve this error, compile with memtrain.checkpointing.compile_model(model) (apply_plan "
                    "does), which compiles such a model block by block with the offloader outside, or drop the "
                    "activation offload.")
            call = functools.partial(_checkpointed_call, self.original, self.spec, self.checkpoint_kwargs, self.norms)
        with offloader:
            return call(*args, **kwargs)


def _in_compiled_region() -> bool:
    """Whether a ``torch.compile``d call is running (dynamo's frame callback is installed), traced or not."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # a torch built without dynamo compiles nothing
        return False
    return get_eval_frame_callback() not in (None, False)


# -- choosing blocks ----------------------------------------------------------------------------------------
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _signature(module: nn.Module) -> Any:
    """A module's class; for containers, also the signatures of their children, in order (so that
    ``Sequential(Linear, GELU, Linear)`` blocks written without a class of their own compare equal)."""
    if isinstance(module, _CONTAINERS):
        return type(module), tuple((name, _signature(child)) for name, child in module.named_children())
    return type(module)


def _describe(module: nn.Module) -> str:
    """``Sequential(Linear, GELU)`` for containers, the class name otherwise: for error messages."""
    if isinstance(module, _CONTAINERS):
        inner = [_describe(child) for child in module.children()]
        return f"{type(module).__name__}({', '.join(inner[:4])}{', ...' if len(inner) > 4 else ''})"
    return type(module).__name__


def _auto_blocks(model: nn.Module) -> list[str]:
    """Repeated blocks: Hugging Face ``_no_split_modules``, else the children of a ModuleList/Sequential that are
    alike (one class, or structurally identical nn.Sequential blocks), else a composite class that repeats."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    if no_split:
        names = [
            name for name, m in model.named_modules()
            if name and any(cls.__name__ in no_split for cls in type(m).__mro__)
        ]
        names = _outermost(names)
        if names:
            return names

    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(children) >= 2:
            kinds = {_signature(child) for _, child in children}
            # A ModuleList or ModuleDict has no forward of its own: it cannot be a block.
            callable_kind = not isinstance(children[0][1], (nn.ModuleList, nn.ModuleDict))
            if len(kinds) == 1 and callable_kind and all(_has_parameters(child) for _, child in children):
                found.extend(f"{prefix}{name}" for name, _ in children)
                return
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    if found:
        modules = dict(model.named_modules())
        kind = type(modules[found[0]])
        if issubclass(kind, _CONTAINERS) or next(modules[found[0]].children(), None) is None:
            # Leaf blocks (nn.Linear) or Sequential blocks: only the container's children. A head of the same
            # class outside it would recompute a matmul to save nothing; any other Sequential is no block.
            return found
        # Composite blocks of the same class outside such a container count too (ResNet: a stage of one block).
        return _outermost([name for name, m in modules.items() if name and type(m) is kind])
    # No container of repeated blocks: fall back to the composite module class that repeats most often
    # (e.g. ResNet stages of one BasicBlock each).
    counts: dict[type, list[str]] = {}
    for name, m in model.named_modules():
        if name and not isinstance(m, _CONTAINERS) and next(m.children(), None) is not None and _has_parameters(m):
            counts.setdefault(type(m), []).append(name)
    repeated = [_outermost(names) for names in counts.values() if len(names) >= 2]
    return max(repeated, key=len, default=[])


def _no_blocks_problem(model: nn.Module) -> str:
    return (f"{_no_blocks_found(model)}. To resolve this error, pass blocks= a module class, a list of module names, "
            "or a predicate (name, module) -> bool.")


def _no_blocks_found(model: nn.Module) -> str:
    """What auto-detection looked for and what the model holds instead (no fix: callers differ in theirs)."""
    containers = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, (nn.Sequential, nn.ModuleList)) and len(m) >= 2]
    seen = ""
    if containers:
        name, largest = max(containers, key=lambda item: len(item[1]))
        where = f"container {name!r}" if name else "the model itself"
        seen = f" ({where} is the largest container; it holds {', '.join(_describe(c) for c in largest.children())})"
        if len(seen) > 300:
            seen = seen[:296] + "...)"
    return (
        f"no repeated blocks found in {type(model).__name__}: auto-detection looks for an nn.ModuleList or "
        "nn.Sequential of two or more modules with parameters that are alike (one class, or structurally "
        "identical nn.Sequential blocks), a module class with submodules that repeats, or Hugging Face "
        f"_no_split_modules, and found none{seen}"
    )


def _outermost(names: list[str]) -> list[str]:
    return [n for n in names if not any(n.startswith(other + ".") for other in names if other != n)]


def _select_blocks(model: nn.Module, blocks: BlockSelector, problems: list[str]) -> list[str]:
    modules = dict(model.named_modules())
    if blocks is None:
        names = _auto_blocks(model)
        if not names:
            problems.append(_no_blocks_problem(model))
        return names
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)):
        names = [name for name, m in modules.items() if name and isinstance(m, blocks)]
        what = f"blocks={blocks!r}"
    elif callable(blocks):
        names = [name for name, m in modules.items() if name and blocks(name, m)]
        what = "the blocks predicate"
    elif isinstance(blocks, Sequence) and not isinstance(blocks, (str, bytes)) and all(
        isinstance(b, str) for b in blocks
    ):
        if not blocks:
            # Not "checkpoint nothing" (remove_checkpointing says that): an empty list is most often a filter that
            # matched nothing upstream, and wrapping nothing would hide it until the run runs out of memory.
            problems.append(f"blocks={blocks!r} selects no module. To resolve this error, pass the names of the "
                            "blocks to checkpoint, blocks=None to auto-detect them, or call "
                            "remove_checkpointing(model) for none.")
        unknown = [b for b in blocks if b not in modules or b == ""]
        for name in unknown:
            close = difflib.get_close_matches(name, list(modules), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            problems.append(
                f"blocks: {type(model).__name__} has no submodule named {name!r}.{hint} To resolve this error, "
                "pass qualified names as printed by model.named_modules()."
            )
        names = [b for b in dict.fromkeys(blocks) if b not in unknown]
        what = None
    else:
        problems.append(
            f"blocks={blocks!r} is not a module class, a tuple of classes, a predicate or a list of names. "
            "To resolve this error, pass one of those, or None to auto-detect the repeated blocks."
        )
        return []
    if what is not None and not names:
        candidates = _auto_blocks(model)[:3]
        hint = f" (auto-detection would pick {candidates} ...)" if candidates else ""
        problems.append(
            f"{what} matches no submodule of {type(model).__name__}{hint}. To resolve this error, pass a class "
            "or predicate that matches the blocks, or blocks=None to auto-detect them."
        )
    nested = [n for n in names if any(n.startswith(other + ".") for other in names if other != n)]
    if nested:
        problems.append(
            f"blocks selects modules nested inside other selected blocks ({nested[:3]}...): the inner ones would "
            "be recomputed twice. To resolve this error, select blocks that do not contain each other."
        )
    return names


def _check_model(model: nn.Module, problems: list[str]) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"apply_checkpointing needs an nn.Module, got {type(model).__name__}. To resolve this "
                          "error, pass the model (an nn.Module) whose blocks to checkpoint.")
    if not _has_parameters(model):
        problems.append(
            f"{type(model).__name__} has no parameters, so there is no gradient to checkpoint for. "
            "To resolve this error, pass the model being trained."
        )
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except ImportError:  # torch built without distributed
        ActivationWrapper = ()  # noqa: N806
    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, ActivationWrapper)]
    if wrapped:
        problems.append(
            f"modules {wrapped[:3]} are already wrapped by torch's checkpoint_wrapper; wrapping again would "
            "recompute them twice. To resolve this error, build the model without checkpoint_wrapper and let "
            "apply_checkpointing choose the blocks."
        )
    hf_flag = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5; older: is_gradient_checkpointing
    if hf_flag is None:
        hf_flag = getattr(model, "is_gradient_checkpointing", False)
    if hf_flag:
        problems.append(
            f"{type(model).__name__} has Hugging Face gradient checkpointing enabled; both together would "
            "recompute every block twice. To resolve this error, call model.gradient_checkpointing_disable() "
            "before apply_checkpointing (or use one of the two)."
        )


def _resolve_selective(selective: SelectivePolicy | Sequence[str] | None, problems: list[str]) -> SelectivePolicy | None:
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


# -- public API ---------------------------------------------------------------------------------------------
def apply_checkpointing(
    model: nn.Module,
    *,
    blocks: BlockSelector = None,
    every: int = 1,
    selective: SelectivePolicy | Sequence[OpKind] | None = None,
    offload: bool = False,
    policies: Mapping[str, BlockPolicy] | None = None,
    offloader: ActivationOffloader | None = None,
) -> list[str]:
    """Checkpoints the repeated blocks of ``model`` in place: one extra forward of time for their activations.

    On an 8-block GPT full checkpointing keeps only each block's input and the loss (at least 10x fewer saved
    bytes: ``pytest tests/test_checkpointing.py -k 10x``); ``every=2`` about halves the saved bytes; ``selective`` keeps matmul and
    attention outputs, saving less memory than full checkpointing but recomputing only cheap ops.

    Args:
        model: any ``nn.Module``, Hugging Face ``PreTrainedModel`` included (its ``use_cache`` is switched off;
            ``remove_checkpointing`` switches it back).
        blocks: which modules to wrap. ``None`` auto-detects the repeated blocks (Hugging Face
            ``_no_split_modules``, else the children of an ``nn.ModuleList``/``nn.Sequential`` that are alike:
            one class, or structurally identical ``nn.Sequential`` blocks); or a module class (or tuple), a
            predicate ``(name, module) -> bool``, or a list of qualified names.
        every: checkpoint one block in ``every`` (blocks 0, k, 2k, ...); 1 checkpoints all of them.
        selective: op kinds whose outputs are kept instead of recomputed, e.g. ``("matmul", "attention")``, or a
            ``SelectivePolicy``. ``None`` recomputes the whole block.
        offload: keep the recomputed blocks' saved inputs in pinned host memory, copied on a side stream and
            prefetched before backward needs them (a no-op, said once, without CUDA).
        policies: a per-block choice overriding ``every``: ``{name: "keep" | "recompute" | "offload"}`` for
            blocks among those selected; "offload" keeps every activation of the block in host memory and
            recomputes nothing (PCIe traffic instead of compute).
        offloader: the ``ActivationOffloader`` the offloaded blocks share (default:
            ``offload_activations(device=<the model's device>)``, built when ``offload`` or a policy needs it).

    Returns:
        The qualified names of the modules wrapped. Calling again replaces the previous wrapping with the new
        settings: a block is never wrapped twice.

    Raises:
        ConfigError: blocks that match nothing, ``every < 1``, an unknown policy, a model without parameters, or
            a model already checkpointed by torch's ``checkpoint_wrapper`` or Hugging Face; every problem at once.

    Example:
        >>> from memtrain.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, seq_len=16))
        >>> apply_checkpointing(model)
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
        >>> apply_checkpointing(model, every=2)
        ['blocks.0', 'blocks.2']
    """
    problems: list[str] = []
    _check_model(model, problems)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        problems.append(f"every={every!r}: it must be an integer >= 1. To resolve this error, pass every=1 "
                        "(every block) or every=2 (one block in two).")
        every = 1
    policy = _resolve_selective(selective, problems)
    names = _select_blocks(model, blocks, problems) if _has_parameters(model) else []
    choices = {name: ("recompute" if i % every == 0 else "keep") for i, name in enumerate(names)}
    for name, choice in (policies or {}).items():
        if choice not in get_args(BlockPolicy):
            problems.append(f"policies[{name!r}]={choice!r}: unknown policy. To resolve this error, use one of "
                            f"{list(get_args(BlockPolicy))}.")
        elif name not in choices:
            problems.append(f"policies names {name!r}, which is not one of the selected blocks ({names[:3]}...). "
                            "To resolve this error, use the names apply_checkpointing(model) returns.")
        else:
            choices[name] = choice
    if offloader is not None and not isinstance(offloader, ActivationOffloader):
        problems.append(f"offloader={type(offloader).__name__}: it must be an ActivationOffloader. To resolve "
                        "this error, pass offload_activations(...) or leave it None.")
    ConfigError.raise_if(problems)
    if offloader is None and (offload or "offload" in choices.values()):
        # One offloader for the whole model: one pinned pool, one recorded backward order.
        offloader = offload_activations(device=next(model.parameters()).device)
    if offloader is not None:
        # Entered per block, it is not given the model: it must still know the weights (frozen ones and their
        # autocast copies too), which stay on the device.
        offloader.track_state(model)

    # Re-wrapping with new settings starts from a clean model, so "every" means the same on every call.
    remove_checkpointing(model)
    modules = dict(model.named_modules())
    recompute = CheckpointSpec(selective=policy, offloader=offloader if offload else None)
    offloaded = CheckpointSpec(policy="offload", offloader=offloader)
    chosen = [name for name in names if choices[name] != "keep"]
    for name in chosen:
        _wrap(modules[name], offloaded if choices[name] == "offload" else recompute)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None):
        # A KV cache would be appended to twice (forward and recompute); it is useless in training anyway.
        setattr(model, _USE_CACHE_ATTR, True)
        config.use_cache = False
    compiled = getattr(model, _COMPILE_ATTR, None)
    if compiled is not None:
        _compile_blocks(model, compiled)  # compile_model compiled the earlier wrapping per block: so this one
    return chosen


def _wrap(module: nn.Module, spec: CheckpointSpec) -> None:
    had_instance_forward = "forward" in module.__dict__
    module.forward = _CheckpointedForward(module, module.forward, had_instance_forward, spec)  # type: ignore[method-assign]
    setattr(module, _WRAPPED_ATTR, spec)


def compile_model(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """``torch.compile`` for a model memtrain checkpoints: one compiled model where dynamo can trace every block,
    else one compiled region per block, with each block's activation offloader outside it.

    An offloader's saved-tensor hooks cannot be traced: ``torch.compile(model)`` would break its graph at the
    first offloaded block and, that being inside the loop over blocks, run the whole forward eagerly. Compiled
    per block, each block's checkpointed call (or, for an offloaded block, its forward) is a compiled region
    entered inside the offloader's context, whose hooks then see that region's saved tensors; the blocks without
    an offloader are compiled whole (``module.compile``), and the code between blocks (embeddings, the last norm,
    the head and the loss) runs eagerly.

    The choice is kept on the model: blocks wrapped again later (a re-plan calls ``apply_checkpointing``) are
    compiled the same way.

    Args:
        model: the model, checkpointed already (a DDP wrapper too: its module's blocks are compiled), or what an
            earlier call returned.
        **compile_kwargs: passed to ``torch.compile`` (e.g. ``backend="aot_eager"``).

    Returns:
        ``torch.compile(model)``, or ``model`` itself with its blocks compiled.
    """
    # Compiled before (a re-plan that wrapped the blocks again): compiled anew as the blocks now are, since a
    # whole-model graph cannot hold blocks that started offloading.
    model = getattr(model, "_orig_mod", model)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if not any(isinstance(f, _CheckpointedForward) and f.offloader is not None for f in _wrapped_forwards(inner)):
        return torch.compile(model, **compile_kwargs)  # type: ignore[return-value]
    setattr(inner, _COMPILE_ATTR, dict(compile_kwargs))
    _compile_blocks(inner, compile_kwargs)
    return model


_COMPILE_ATTR = "_memtrain_compile_per_block"


def _wrapped_forwards(model: nn.Module) -> list[Any]:
    return [m.__dict__.get("forward") for m in model.modules()]


def _compile_blocks(model: nn.Module, compile_kwargs: dict[str, Any]) -> None:
    modules = dict(model.named_modules())
    for name in dict.fromkeys([*find_blocks(model), *checkpointed_blocks(model)]):
        module = modules[name]
        forward = module.__dict__.get("forward")
        if isinstance(forward, _CheckpointedForward) and forward.offloader is not None:
            module._compiled_call_impl = None  # compiled whole before (a re-plan): the offloader must stay outside
            if forward.compiled is None:
                forward.compiled = torch.compile(functools.partial(
                    _checkpointed_call, forward.original, forward.spec, forward.checkpoint_kwargs, forward.norms),
                    **compile_kwargs)
        elif getattr(module, "_compiled_call_impl", None) is None and not any(
                isinstance(f, _CheckpointedForward) and f.offloader is not None for f in _wrapped_forwards(module)):
            module.compile(**compile_kwargs)


def find_blocks(model: nn.Module) -> list[str]:
    """The qualified names of the repeated blocks ``apply_checkpointing(model)`` would wrap (also what FSDP2
    shards one by one)."""
    return _auto_blocks(model)


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that memtrain checkpoints now."""
    return [name for name, m in model.named_modules() if isinstance(m.__dict__.get("forward"), _CheckpointedForward)]


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undoes ``apply_checkpointing``: restores each block's forward and the model's ``use_cache``.

    Returns:
        The qualified names of the modules unwrapped.
    """
    removed = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, _CheckpointedForward):
            if forward.had_instance_forward:
                module.forward = forward.original  # type: ignore[method-assign]
            else:
                del module.forward
            delattr(module, _WRAPPED_ATTR)
            removed.append(name)
    if getattr(model, _USE_CACHE_ATTR, False):
        model.config.use_cache = True
        delattr(model, _USE_CACHE_ATTR)
    return removed


def checkpoint_sequential(
    functions: nn.Sequential | Sequence[nn.Module],
    segments: int,
    input: torch.Tensor,
    *,
    selective: SelectivePolicy | Sequence[OpKind] | None = None,
) -> torch.Tensor:
    """Runs ``functions`` in ``segments`` chunks, checkpointing every chunk but the last.

    The last chunk is not checkpointed: backward needs its activations at once, so recomputing them would cost
    time and save nothing. Non-reentrant, RNG-exact and BatchNorm-safe, like ``apply_checkpointing``.

    Args:
        functions: an ``nn.Sequential`` or a list of modules applied in order.
        segments: number of chunks, 1 to ``len(functions)``.
        input: the input of the first module.
        selective: as in ``apply_checkpointing``.

    Example:
        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> checkpoint_sequential(layers, 2, torch.randn(3, 8)).shape
        torch.Size([3, 8])
    """
    modules = list(functions)
    problems: list[str] = []
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= max(len(modules), 1):
        problems.append(f"segments={segments!r}: it must be an integer from 1 to {len(modules)} (the number of "
                        "modules). To resolve this error, pass e.g. segments=2.")
    if not modules:
        problems.append("checkpoint_sequential got no modules. To resolve this error, pass a non-empty nn.Sequential.")
    policy = _resolve_selective(selective, problems)
    ConfigError.raise_if(problems)
    spec = CheckpointSpec(selective=policy)
    checkpoint_kwargs = spec.checkpoint_kwargs
    bounds = [round(i * len(modules) / segments) for i in range(segments + 1)]
    x = input
    for i, (start, stop) in enumerate(zip(bounds, bounds[1:], strict=False)):
        chunk = modules[start:stop]
        run = functools.partial(_run_chunk, chunk)
        if i == segments - 1:
            x = run(x)
        else:
            norms = [n for m in chunk for n in _running_stat_modules(m)]
            x = _checkpointed_call(run, spec, checkpoint_kwargs, norms, x)
    return x


def _run_chunk(chunk: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for module in chunk:
        x = module(x)
    return x


# -- the typed policy ---------------------------------------------------------------------------------------
CheckpointingMode = Literal["none", "all", "every", "selective", "blocks"]

_LETTERS: dict[BlockPolicy, str] = {"recompute": "R", "keep": "K", "offload": "O"}
_SPELLINGS = ("'none', 'all', 'every:K' (K >= 1), 'selective' or e.g. 'selective(matmul,attention)', "
              "'blocks(RKO...)' (a letter per block: R recompute, K keep, O offload), each optionally followed by "
              "'+offload' (the recomputed blocks' inputs in host memory); an integer K (every:K); True (all); "
              "False or None (none); or a Checkpointing")


@dataclass(frozen=True)
class Checkpointing:
    """Which blocks recompute in backward, which keep their activations, which offload them.

    A recomputed block costs about one extra forward of it and keeps only its input; a kept block costs no time
    and keeps every activation; an offloaded block keeps them in pinned host memory (PCIe traffic instead of
    compute). One typed value for every place that names a policy: ``parse`` reads each accepted spelling,
    ``str`` writes one that ``parse`` reads back, ``apply`` configures a model, ``block_policies`` says what each
    block does (for the planner and the estimator).

    Args:
        mode: "none" (no block recomputes), "all", "every" (one block in ``every``), "selective" (every block,
            keeping the outputs of the op kinds in ``selective``), "blocks" (one policy per block: ``blocks``).
        every: with mode="every": blocks 0, every, 2*every, ... recompute, the others keep.
        selective: with mode="selective": the op kinds kept (default ``SelectivePolicy()``: matmul, attention).
        blocks: with mode="blocks": "keep" / "recompute" / "offload" for each detected block, in order.
        offload_inputs: the recomputed blocks' saved inputs wait in pinned host memory (a no-op without CUDA).

    Raises:
        ConfigError: every problem of the combination at once (an unknown mode, ``every < 1``, a field given for
            another mode, unknown op kinds or block policies, ``offload_inputs`` with mode="none").

    Example:
        >>> Checkpointing.parse("every:2")
        Checkpointing(mode='every', every=2, selective=None, blocks=(), offload_inputs=False)
        >>> str(Checkpointing(mode="blocks", blocks=("recompute", "keep", "offload")))
        'blocks(RKO)'
        >>> Checkpointing.parse("all+offload").block_policies(3)
        ('recompute', 'recompute', 'recompute')
    """

    mode: CheckpointingMode = "all"
    every: int = 1
    selective: SelectivePolicy | None = None
    blocks: tuple[BlockPolicy, ...] = ()
    offload_inputs: bool = False

    def __post_init__(self) -> None:
        problems: list[str] = []
        modes = get_args(CheckpointingMode)
        if self.mode not in modes:
            problems.append(f"mode={self.mode!r} is not a checkpointing mode. To resolve this error, use one of "
                            f"{list(modes)}.")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            problems.append(f"every={self.every!r}: it must be an integer >= 1. To resolve this error, pass e.g. "
                            "every=2 (one block in two recomputes).")
        elif self.every != 1 and self.mode != "every":
            problems.append(f"every={self.every} applies only with mode='every', not mode={self.mode!r}. To "
                            "resolve this error, pass mode='every', or leave every at 1.")
        selective = self.selective
        if selective is not None:
            if self.mode != "selective":
                problems.append(f"selective={selective!r} applies only with mode='selective', not "
                                f"mode={self.mode!r}. To resolve this error, pass mode='selective' or "
                                "selective=None.")
            selective = _resolve_selective(selective, problems)
            if selective is not None:  # a hashable policy: SelectivePolicy(keep=[...]) holds a list
                selective = SelectivePolicy(keep=tuple(selective.keep))
        elif self.mode == "selective":
            selective = SelectivePolicy()  # the documented default: keep matmul and attention outputs
        object.__setattr__(self, "selective", selective)
        blocks = self.blocks
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
            problems.append(f"blocks={blocks!r}: it must be a sequence of block policies. To resolve this "
                            "error, pass e.g. blocks=('recompute', 'keep', 'offload').")
            blocks = ()
        blocks = tuple(blocks)
        object.__setattr__(self, "blocks", blocks)
        unknown = [b for b in blocks if b not in _LETTERS]
        if unknown:
            problems.append(f"blocks: unknown block policies {unknown}. To resolve this error, use "
                            f"{list(get_args(BlockPolicy))}.")
        if self.mode == "blocks" and not blocks:
            problems.append("mode='blocks' needs one policy per block, and blocks=() gives none. To resolve this "
                            "error, pass e.g. blocks=('recompute', 'recompute', 'keep') (spelled 'blocks(RRK)': a "
                            "letter per block, R recompute, K keep, O offload), or another mode.")
        elif self.mode != "blocks" and blocks:
            problems.append(f"blocks={blocks!r} applies only with mode='blocks', not mode={self.mode!r}. To "
                            "resolve this error, pass mode='blocks' or blocks=().")
        if not isinstance(self.offload_inputs, bool):
            problems.append(f"offload_inputs={self.offload_inputs!r}: it must be True or False. To resolve this "
                            "error, pass offload_inputs=True or False.")
        elif self.offload_inputs and self.mode == "none":
            problems.append("offload_inputs=True with mode='none': no block recomputes, so no block input is "
                            "saved alone to offload. To resolve this error, pass a mode that recomputes, or wrap "
                            "the whole forward in offload_activations(model=...).")
        ConfigError.raise_if(problems)

    @classmethod
    def parse(cls, value: Any) -> Checkpointing:
        """The policy a CLI flag, a config file or an argument names (see the class docstring's spellings).

        Raises:
            ConfigError: a value that is none of the accepted spellings, or a bad combination.
        """
        if isinstance(value, Checkpointing):
            return value
        if value is None or value is False:
            return cls(mode="none")
        if value is True:
            return cls(mode="all")
        if isinstance(value, int):
            if value >= 1:
                return cls(mode="every", every=value)
            raise ConfigError(f"checkpointing={value!r}: an integer K means every:K, so it must be >= 1. To "
                              f"resolve this error, pass one of {_SPELLINGS}.")
        if isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            offload = text.endswith("+offload")
            text = text.removesuffix("+offload")
            if text in ("none", "all"):
                return cls(mode=text, offload_inputs=offload)  # type: ignore[arg-type]
            if match := re.fullmatch(r"every:(\d+)", text):
                return cls(mode="every", every=int(match[1]), offload_inputs=offload)
            if match := re.fullmatch(r"selective(?:\(([a-z_,]*)\))?", text):
                keep = tuple(match[1].split(",")) if match[1] is not None else None
                return cls(mode="selective", offload_inputs=offload,
                           selective=SelectivePolicy(keep=keep) if keep is not None else None)  # type: ignore[arg-type]
            if match := re.fullmatch(r"blocks\(([rko]+)\)", text):
                by_letter = {letter.lower(): policy for policy, letter in _LETTERS.items()}
                return cls(mode="blocks", blocks=tuple(by_letter[c] for c in match[1]), offload_inputs=offload)
            if match := re.fullmatch(r"blocks(?:\((.*)\))?", text):
                others = sorted(set(match[1] or "") - set("rko"))
                what = (f"{', '.join(map(repr, others))} {'is not a block letter' if len(others) == 1 else 'are not block letters'}"
                        if others else "it names no block")
                raise ConfigError(f"checkpointing={value!r}: {what}; a block layout takes a letter per block (R "
                                  "recompute, K keep, O offload), in the order find_blocks(model) returns them. To "
                                  "resolve this error, pass e.g. 'blocks(RRK)' for three blocks, or another policy.")
            if text == "auto":
                raise ConfigError("checkpointing='auto' is not a policy but a request that the planner choose "
                                  "one. To resolve this error, let memtrain's planner resolve 'auto' (train does) "
                                  f"and parse its choice, or pass one of {_SPELLINGS}.")
        raise ConfigError(f"checkpointing={value!r} is not a checkpointing policy. To resolve this error, pass "
                          f"one of {_SPELLINGS}.")

    def __str__(self) -> str:
        if self.mode == "every":
            text = f"every:{self.every}"
        elif self.mode == "selective":
            text = f"selective({','.join(self.selective.keep)})"  # type: ignore[union-attr]
        elif self.mode == "blocks":
            text = f"blocks({''.join(_LETTERS[b] for b in self.blocks)})"
        else:
            text = self.mode
        return text + ("+offload" if self.offload_inputs else "")

    def block_policies(self, n_blocks: int) -> tuple[BlockPolicy, ...]:
        """What each of ``n_blocks`` blocks does: "keep", "recompute" (selective ones included) or "offload"."""
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
            raise ConfigError(f"n_blocks={n_blocks!r}: it must be an integer >= 0 (the number of blocks). To resolve "
                              "this error, pass len(find_blocks(model)).")
        if self.mode == "none":
            return ("keep",) * n_blocks
        if self.mode == "every":
            return tuple("recompute" if i % self.every == 0 else "keep" for i in range(n_blocks))
        if self.mode == "blocks":
            if len(self.blocks) != n_blocks:
                raise ConfigError(f"checkpointing {self} names {len(self.blocks)} blocks, not {n_blocks}. To "
                                  "resolve this error, give one policy per block, in the model's order.")
            return self.blocks
        return ("recompute",) * n_blocks

    def apply(self, model: nn.Module, *, offloader: ActivationOffloader | None = None) -> list[str]:
        """Checkpoints ``model`` in place by this policy (through ``apply_checkpointing``; "none" removes any
        checkpointing) and returns the qualified names of the wrapped blocks.

        Raises:
            ConfigError: as ``apply_checkpointing``; mode="blocks" with a policy count that is not the number
                of blocks ``find_blocks(model)`` detects.
        """
        kwargs = self.arguments(model)
        if kwargs is None:
            remove_checkpointing(model)
            return []
        return apply_checkpointing(model, **kwargs, offloader=offloader)

    def arguments(self, model: nn.Module) -> dict[str, Any] | None:
        """``apply_checkpointing``'s keyword arguments for this policy on ``model`` (None for mode="none").

        Raises:
            ConfigError: mode="blocks" with a policy count that is not the number of blocks of ``model``.
        """
        if self.mode == "none":
            return None
        kwargs: dict[str, Any] = {"offload": self.offload_inputs}
        if self.mode == "every":
            kwargs["every"] = self.every
        elif self.mode == "selective":
            kwargs["selective"] = self.selective
        elif self.mode == "blocks":
            if not isinstance(model, nn.Module):
                raise ConfigError(f"checkpointing {self}: model is a {type(model).__name__}, not an nn.Module. To "
                                  "resolve this error, pass the model whose blocks the letters name.")
            names = find_blocks(model)
            if not names:
                raise ConfigError(f"checkpointing {self} gives one policy per detected block, but "
                                  f"{_no_blocks_found(model)}. To resolve this error, name the blocks with "
                                  "apply_checkpointing(model, blocks=[...], policies={name: policy}), or pass "
                                  "checkpointing='none'.")
            if len(names) != len(self.blocks):
                raise ConfigError(
                    f"checkpointing {self} names {len(self.blocks)} blocks, but {type(model).__name__} has "
                    f"{len(names)} ({names[0]} ... {names[-1]}). To resolve this error, give one policy per block, "
                    "in the order find_blocks(model) returns them."
                )
            kwargs["policies"] = dict(zip(names, self.blocks, strict=True))
        return kwargs
