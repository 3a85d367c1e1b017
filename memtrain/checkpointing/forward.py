"""The checkpointed forward of a wrapped block.

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
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from memtrain.checkpointing.selective import SelectivePolicy, selective_contexts
from memtrain.errors import ConfigError
from memtrain.offload import ActivationOffloader

# torch >= 2.14 asks whether a selective region's kept outputs go through the saved-tensor hooks around it (its
# default, None, warns while a hook is active: memtrain's meter and activation offloader are such hooks). They stay
# in checkpoint's cache, as on every torch before: the meter counts them from memtrain's caching mode (through the
# hooks too, they would count twice) and the offloader moves only what autograd saves (they would cross the link).
_KEPT_OUTSIDE_HOOKS = ({"respect_saved_tensors_hooks": False}
                       if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


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
        return {"context_fn": selective_contexts(tuple(self.selective.keep))} if self.selective is not None else {}


def running_stat_modules(module: nn.Module) -> list[nn.Module]:
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


def let_compiled_checkpoints_run_side_effects_once() -> None:
    """Lets torch.compile trace a checkpointed block whose forward changes Python state (dynamo's
    ``skip_fwd_side_effects_in_bwd_under_checkpoint``), so that the block stays in the graph.

    Without it dynamo breaks the graph at such a block and runs the whole forward eagerly: every attention layer
    of transformers >= 5.25 sets and resets the ``kernels`` package's context variable in its forward. Eager
    checkpointing replays a side effect in the recompute; a compiled one then applies it once, in forward, as
    memtrain already does for BatchNorm's running statistics. A set-and-reset such as that context variable's
    leaves the same state either way. Torch builds without the setting (before 2.9) keep their behaviour.
    """
    config = torch._dynamo.config
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def checkpointed_call(
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
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **_KEPT_OUTSIDE_HOOKS,
                      **checkpoint_kwargs, **kwargs)


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


class CheckpointedForward:
    """The instance-level ``forward`` of a wrapped block."""

    def __init__(self, module: nn.Module, original: Callable[..., Any], had_instance_forward: bool,
                 spec: CheckpointSpec):
        self.original = original
        self.had_instance_forward = had_instance_forward
        self.spec = spec
        self.norms = running_stat_modules(module)
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
            return checkpointed_call(self.original, self.spec, self.checkpoint_kwargs, self.norms, *args, **kwargs)
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
            call = functools.partial(checkpointed_call, self.original, self.spec, self.checkpoint_kwargs, self.norms)
        with offloader:
            return call(*args, **kwargs)


def _in_compiled_region() -> bool:
    """Whether a ``torch.compile``d call is running (dynamo's frame callback is installed), traced or not."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # a torch built without dynamo compiles nothing
        return False
    return get_eval_frame_callback() not in (None, False)


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` that memtrain checkpoints now."""
    return [name for name, m in model.named_modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]
