"""The optimizer's bytes, by formula: its state and step temporaries on the device, what it keeps in host memory,
and which gradients leave the device as autograd produces them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from memtrain.estimate.tracker import round_up
from memtrain.optim import OptimizerMemory, offloaded_mask, optimizer_memory
from memtrain.optim.probe import PROBE_NUMEL
from memtrain.techniques.optimizer import NamedOptimizer


@dataclass
class OptimizerFigures:
    """The optimizer of a traced step, in bytes, with the assumption that explains them."""

    state_bytes: int  # state on the device
    step_temp_bytes: int  # the step's temporaries on the device
    host_bytes: int  # state (and gradient buffers) in host memory
    all_state_bytes: int  # state wherever it lives
    note: str
    # Gradients that do not stay on the device once accumulated: CPUOffloadOptimizer (one process) copies each to
    # the host as autograd produces it; a parameter that steps in backward frees its own.
    leaving: list[nn.Parameter] = field(default_factory=list)


# estimate's names for torch's optimizers: each is a named class, measured by its probe step like any other.
KINDS = {"sgd": ("torch.optim.SGD", {}), "sgd-momentum": ("torch.optim.SGD", {"momentum": 0.9}),
         "adafactor": ("torch.optim.Adafactor", {})}


def as_optimizer(optimizer: Any) -> str | NamedOptimizer:
    """``estimate``'s ``optimizer=``: "adamw" or "adamw-offload" (memtrain's AdamW, on the device or offloaded), or
    the ``NamedOptimizer`` an estimate name ("sgd", "sgd-momentum", "adafactor"), a short name, a dotted path or a
    class names.

    Raises:
        ConfigError: a value that names no optimizer.
    """
    if isinstance(optimizer, str) and optimizer in ("adamw", "adamw-offload"):
        return optimizer
    if isinstance(optimizer, str) and optimizer in KINDS:
        return NamedOptimizer.of(*KINDS[optimizer])
    return NamedOptimizer.of(optimizer)


def optimizer_bytes(params: Sequence[nn.Parameter], kind: str, round_to: int) -> tuple[int, int, int, str]:
    """(device state bytes, device step-temporary bytes, host bytes, assumption) of torch's fused AdamW."""
    if kind != "adamw":
        raise AssertionError(f"optimizer_bytes: {kind!r} is counted by memtrain.optim.optimizer_memory")
    # Fused/capturable AdamW keeps its step counter as a 4-byte tensor on the device, one per parameter (on the
    # CPU every AdamW does: the step is a CPU tensor).
    step_bytes = len(params) * round_up(4, round_to)
    return (2 * sum(round_up(p.numel() * p.element_size(), round_to) for p in params) + step_bytes, 0, 0,
            "AdamW fused (torch.optim.AdamW(fused=True)): exp_avg and exp_avg_sq in the parameter dtype, no "
            "step temporaries; the foreach implementation would add one fp32 copy of the parameters")


def _named_figures(trainable: Sequence[nn.Parameter], named: NamedOptimizer, *, offload_fraction: float,
                   step_in_backward: bool, accumulation: int, device_type: str, round_to: int,
                   idle: Sequence[nn.Parameter]) -> OptimizerFigures:
    """A named class's bytes: its state measured by probe steps over each parameter's shape, the host buffers of
    the offloaded share as memtrain's AdamW's."""
    def memory(params: Sequence[nn.Parameter]) -> OptimizerMemory:
        return optimizer_memory([(p.numel(), p.dtype) for p in params], offload_fraction=offload_fraction,
                                step_in_backward=step_in_backward, accumulation_steps=accumulation,
                                device_type=device_type, named=named, shapes=[tuple(p.shape) for p in params],
                                round_to=round_to)

    m = memory(trainable)
    host_bytes = m.host_bytes
    if idle and offload_fraction:
        every = memory([*trainable, *idle])
        host_bytes = m.host_state_bytes + every.host_bytes - every.host_state_bytes
    on_host = offloaded_mask([p.numel() for p in trainable], offload_fraction)
    leaving = [p for p, h in zip(trainable, on_host, strict=True) if h or (step_in_backward and accumulation == 1)]
    note = (f"{named.text}: its state measured by a probe step of the class over each parameter's shape (on the "
            f"CPU), its step's scratch by one on {PROBE_NUMEL:,} elements; {offload_fraction:.0%} of the parameters' "
            f"state in host RAM, step in backward {'on' if step_in_backward else 'off'}")
    return OptimizerFigures(m.device_state_bytes, m.device_step_temp_bytes, host_bytes, m.state_bytes, note, leaving)


def optimizer_figures(trainable: Sequence[nn.Parameter], optimizer: Any, *, lean: bool, state_precision: str,
                      offload_fraction: float, step_in_backward: bool, accumulation: int, device_type: str,
                      round_to: int, idle: Sequence[nn.Parameter] = (), pure_bf16: bool = False) -> OptimizerFigures:
    """The bytes of ``optimizer`` over the ``trainable`` parameters: torch's fused AdamW by formula, a named class
    (``as_optimizer``) by its probe steps, memtrain.optim's AdamW (``lean``: lean moments, offload, step in backward; or ``"adamw-offload"``) by its own byte model.
    ``idle``: trainable parameters that get no gradient: no state (every optimizer creates it lazily), but the
    host buffers memtrain's offloading AdamW builds for every parameter at its start (fp32 master, gradient)."""
    optimizer = as_optimizer(optimizer)
    if isinstance(optimizer, NamedOptimizer):
        return _named_figures(trainable, optimizer, offload_fraction=offload_fraction,
                              step_in_backward=step_in_backward, accumulation=accumulation, device_type=device_type,
                              round_to=round_to, idle=idle)
    leaving: list[nn.Parameter] = []
    if not (lean or optimizer == "adamw-offload"):
        state_bytes, step_temp_bytes, optimizer_host_bytes, optimizer_note = optimizer_bytes(
            trainable, optimizer, round_to)
        all_state_bytes = state_bytes
    else:  # memtrain.optim's AdamW, CPUOffloadOptimizer (adamw-offload: every parameter's state) included
        fraction = 1.0 if optimizer == "adamw-offload" else offload_fraction
        memory = optimizer_memory([(p.numel(), p.dtype) for p in trainable], state_precision=state_precision,
                                  offload_fraction=fraction, step_in_backward=step_in_backward,
                                  accumulation_steps=accumulation, device_type=device_type, pure_bf16=pure_bf16)
        state_bytes, step_temp_bytes = memory.device_state_bytes, memory.device_step_temp_bytes
        optimizer_host_bytes, all_state_bytes = memory.host_bytes, memory.state_bytes
        if idle:  # NOTE: the idle parameters' buffers as if their share were offloaded alike
            every = optimizer_memory([(p.numel(), p.dtype) for p in (*trainable, *idle)],
                                     state_precision=state_precision, offload_fraction=fraction,
                                     step_in_backward=step_in_backward, accumulation_steps=accumulation,
                                     device_type=device_type, pure_bf16=pure_bf16)
            optimizer_host_bytes = memory.host_state_bytes + every.host_bytes - every.host_state_bytes
        on_host = offloaded_mask([p.numel() for p in trainable], fraction)
        leaving = [p for p, h in zip(trainable, on_host, strict=True)
                   if h or (step_in_backward and accumulation == 1)]
        optimizer_note = (f"AdamW from memtrain.optim.build_optimizer: {state_precision} moments, {fraction:.0%} of "
                          f"the parameters' state in host RAM, step in backward {'on' if step_in_backward else 'off'}"
                          " (bytes from memtrain.optim.optimizer_memory; step temporaries an upper bound)"
                          + ("; pure bf16: bf16 weights and gradients, no fp32 master" if pure_bf16 else ""))
        if fraction:
            optimizer_note += ("; offloaded parameters' fp32 masters, moments and gradient buffers in pinned host "
                               "memory, their device gradients counted in full (streaming frees them earlier, so "
                               "the device figure is an upper bound)")
    return OptimizerFigures(state_bytes, step_temp_bytes, optimizer_host_bytes, all_state_bytes, optimizer_note,
                            leaving)
