"""build_optimizer: the one way ``apply_plan`` and ``train`` build the optimizer, every option checked first."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from memtrain.errors import ConfigError
from memtrain.message import arg
from memtrain.optim.composed import ComposedOptimizer
from memtrain.optim.memory import offloaded_mask
from memtrain.optim.moments import adamw_8bit_class, check_precision
from memtrain.optim.pure_bf16 import check_pure_bf16_moments
from memtrain.techniques import SetUp, Terms, problems
from memtrain.techniques.optimizer import NamedOptimizer

# How build_optimizer's arguments read in the rules' messages: an enabled GradScaler is fp16-mixed's.
ARGUMENT_TERMS = Terms(labels={"optimizer": "optimizer_class"},
                       values={"precision": lambda v: f"{v!r} (an fp16 GradScaler)"},
                       fixes={"gradients-before-ddp": f"pass {arg('step_in_backward', False)} and "
                              f"{arg('offload_fraction', 0)} under DDP "
                              "(or use CPUOffloadOptimizer(offload_gradients=False) directly)",
                              "pure-bf16-precision": f"pass {arg('precision', 'bf16-mixed')}"})


def build_optimizer(named_parameters: Iterable[tuple[str, nn.Parameter]], *, lr: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                    state_precision: str = "fp32", offload_fraction: float = 0.0, step_in_backward: bool = False,
                    grad_scaler: torch.amp.GradScaler | None = None, world_size: int = 1,
                    optimizer_class: type[torch.optim.Optimizer] | str | NamedOptimizer = torch.optim.AdamW,
                    optimizer_kwargs: Mapping[str, Any] | None = None, pure_bf16: bool = False) -> ComposedOptimizer:
    """The optimizer ``apply_plan``/``train`` use: AdamW with the chosen state precision (or any other class),
    partial host offload and step-in-backward, as one ``torch.optim.Optimizer``.

    Args:
        named_parameters: ``model.named_parameters()``; parameters that do not require grad (frozen, e.g. under
            LoRA) are skipped.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (one group; LR schedulers change ``lr``).
        state_precision: "fp32" (8 bytes/param of moments), "bf16" (4) or "int8" (about 2; the lowbit extra).
        offload_fraction: share of the parameters (elements) whose fp32 master and state live in host RAM.
        step_in_backward: step each device parameter in backward as its gradient is final, freeing it at once.
        grad_scaler: the fp16 GradScaler in use (needed with offload_fraction > 0 or step_in_backward).
        world_size: ranks training together; step-in-backward needs 1 (DDP and FSDP2 reduce gradients over the ranks
            after the hooks).
        optimizer_class: AdamW (memtrain's, with a state precision and pure bf16), or any other
            ``torch.optim.Optimizer`` class, short name or dotted path (``NamedOptimizer.of``): it gets ``lr`` and
            ``weight_decay`` where it takes them, and ``optimizer_kwargs``; its state is its own (state_precision
            "fp32"), and the wrappers (step in backward, the offloaded share) take it alike.
        optimizer_kwargs: the class's own hyper-parameters (e.g. ``{"beta2_decay": -0.8}`` for Adafactor).
        pure_bf16: the trainable weights are bf16 and have no fp32 master: ``PureBF16AdamW`` steps them (the update
            in fp32, rounded back stochastically), on the device and on the host (moments fp32 or bf16).

    Raises:
        ConfigError: an unknown precision, int8 without bitsandbytes or on a device it cannot run on (naming the
            bf16 fallback), step-in-backward with an optimizer or setting that cannot do it, no trainable
            parameter, non-fp32 weights kept on the device, or a bad fraction.

    Example:
        >>> model = torch.nn.Linear(8, 4)
        >>> opt = build_optimizer(model.named_parameters(), lr=1e-3, state_precision="bf16")
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.state[model.weight]["exp_avg"].dtype
        torch.bfloat16
    """
    check_precision(state_precision)
    as_class = optimizer_class is torch.optim.AdamW and not optimizer_kwargs
    named = NamedOptimizer() if as_class else NamedOptimizer.of(optimizer_class, optimizer_kwargs)
    cls = named.resolve()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world_size = max(world_size, torch.distributed.get_world_size())  # the ranks running now count too
    fp16 = grad_scaler is not None and grad_scaler.is_enabled()
    ConfigError.raise_if(problems(SetUp(
        state_precision=state_precision, step_in_backward=step_in_backward, offload_fraction=offload_fraction,
        optimizer=named, pure_bf16=pure_bf16, precision="fp16-mixed" if fp16 else None, processes=world_size),
        ARGUMENT_TERMS, primitives=True))
    params = [(n, p) for n, p in named_parameters if p.requires_grad]
    if not params:
        raise ConfigError("build_optimizer got no parameter that requires grad. To resolve this error, pass "
                          "model.named_parameters() of a model with trainable parameters.")
    devices = sorted({str(p.device) for _, p in params})
    if len(devices) > 1:
        raise ConfigError(f"the parameters live on several devices ({', '.join(devices)}). To resolve this error, "
                          "move the model to one device first.")
    mask = offloaded_mask([p.numel() for _, p in params], offload_fraction)
    if pure_bf16:
        _check_pure_bf16(params, state_precision)
        return ComposedOptimizer(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         state_precision=state_precision, offload_mask=mask, step_in_backward=step_in_backward,
                         grad_scaler=grad_scaler, pure_bf16=True)
    on_device = [n for (n, p), h in zip(params, mask, strict=True) if not h and p.dtype != torch.float32]
    if on_device:
        raise ConfigError(
            f"{len(on_device)} trainable parameters are not fp32 ({on_device[:3]}...) and would keep their "
            f"{cls.__name__} state on the device without an fp32 master: updates smaller than their dtype's "
            "resolution would be lost. To resolve this error, keep trainable weights in fp32 (autocast computes in bf16), "
            f"or pass {arg('offload_fraction', 1.0)} (the host keeps an fp32 master of bf16 weights).")
    if state_precision == "int8":
        adamw_8bit_class(params[0][1].device.type)  # raises, naming the fallback, before anything is allocated
    if not named.is_adamw and (any(mask) or params[0][1].device.type == "cpu"):
        named.state_sizes((1,), torch.float32)  # a class that cannot step on the host: one clear error, now
    return ComposedOptimizer(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_precision=state_precision,
                     offload_mask=mask, step_in_backward=step_in_backward, grad_scaler=grad_scaler, named=named)


def _check_pure_bf16(named: list[tuple[str, nn.Parameter]], state_precision: str) -> None:
    """ConfigError for what pure bf16 cannot take beyond its rules: weights that are not bf16, moments it has no
    kernel for."""
    problems = []
    try:
        check_pure_bf16_moments(state_precision)
    except ConfigError as e:
        problems += e.problems
    wrong = [n for n, p in named if p.dtype != torch.bfloat16]
    if wrong:
        problems.append(f"{arg('pure_bf16', True)} with {len(wrong)} trainable parameters that are not bf16 "
                        f"({wrong[:3]}). To "
                        "resolve this error, cast the model first (model.to(torch.bfloat16)).")
    ConfigError.raise_if(problems)
