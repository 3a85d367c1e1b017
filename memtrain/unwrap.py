"""The module inside its wrappers (``torch.compile``, DDP, DataParallel, PEFT), and whether FSDP2 sharded it:
what to patch or inspect, where the wrapper is what to call."""

from __future__ import annotations

import sys

from torch import nn


def unwrap_model(model: nn.Module, *, ddp: bool = True, peft: bool = False) -> nn.Module:
    """The module inside ``torch.compile``'s wrapper and (with ``ddp``) DDP's or DataParallel's, at any depth;
    with ``peft`` also inside a PEFT model. What to patch or inspect, where the wrapper is what to call.

    A PEFT model stays one unless ``peft``: it forwards attribute lookups to the model it wraps, so
    ``peft_model.model`` (its ``base_model_prefix``) is the whole causal LM, not its decoder; ``peft=True`` gives
    that causal LM (PEFT calls its forward; the LoRA layers live inside it). FSDP2 is not a wrapper
    (``fully_shard`` changes the module's class in place): an FSDP2 module is returned as it is.
    """
    while True:
        if is_peft_model(model):
            inner = model.get_base_model() if peft else None
        elif ddp and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        else:
            inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def is_peft_model(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PEFT model exists only once peft is imported (importing it takes seconds)
    return peft is not None and isinstance(model, peft.PeftModel)


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` (inside a ``torch.compile`` wrapper too) was sharded by FSDP2's ``fully_shard``."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by fully_shard; importing it here costs 0.5 s
    return fsdp is not None and isinstance(unwrap_model(model), fsdp.FSDPModule)
