"""``compile_model``: torch.compile for a checkpointed model, whole or block by block with each block's activation
offloader outside its compiled region."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from memtrain.checkpointing.blocks import find_blocks
from memtrain.checkpointing.forward import CheckpointedForward, checkpointed_blocks, checkpointed_call


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
    if not any(isinstance(f, CheckpointedForward) and f.offloader is not None for f in _wrapped_forwards(inner)):
        return torch.compile(model, **compile_kwargs)  # type: ignore[return-value]
    setattr(inner, COMPILE_ATTR, dict(compile_kwargs))
    compile_blocks(inner, compile_kwargs)
    return model


COMPILE_ATTR = "_memtrain_compile_per_block"


def _wrapped_forwards(model: nn.Module) -> list[Any]:
    return [m.__dict__.get("forward") for m in model.modules()]


def compile_blocks(model: nn.Module, compile_kwargs: dict[str, Any]) -> None:
    modules = dict(model.named_modules())
    for name in dict.fromkeys([*find_blocks(model), *checkpointed_blocks(model)]):
        module = modules[name]
        forward = module.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward) and forward.offloader is not None:
            module._compiled_call_impl = None  # compiled whole before (a re-plan): the offloader must stay outside
            if forward.compiled is None:
                forward.compiled = torch.compile(functools.partial(
                    checkpointed_call, forward.original, forward.spec, forward.checkpoint_kwargs, forward.norms),
                    **compile_kwargs)
        elif getattr(module, "_compiled_call_impl", None) is None and not any(
                isinstance(f, CheckpointedForward) and f.offloader is not None for f in _wrapped_forwards(module)):
            module.compile(**compile_kwargs)
