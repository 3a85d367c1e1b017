"""What ``GradientAccumulator`` asks of an optimizer beyond ``torch.optim.Optimizer``'s, declared once.

A plain torch optimizer (any class, memtrain's fused AdamW, a named one) keeps its gradients in ``p.grad`` and steps
after backward: the accumulator normalises, clips and unscales them itself. memtrain's wrappers change that, and say
so through ``HostGradientOptimizer`` and ``InBackwardOptimizer``: ``CPUOffloadOptimizer`` keeps the gradients in host memory (the accumulator hands
it the factor and the clip, folded into the host step), ``ComposedOptimizer`` with ``step_in_backward`` steps inside the
window's last backward (the factor and the clip are handed over before it). ``OptimizerTraits.of`` reads what an
optimizer declares, with a plain optimizer's answer for whatever it does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class HostGradientOptimizer(Protocol):
    """An optimizer whose gradients live (partly) in host memory (``CPUOffloadOptimizer``, ``ComposedOptimizer`` with a
    host part): the accumulator normalises and clips through it, and announces the window's last backward."""

    # This step's gradients are (partly) not in ``p.grad``: ``scale_gradients_`` and ``clip_grad_norm_`` reach them.
    manages_gradients: bool
    # ``step()`` reads an fp16 overflow from its own host gradients and hands it to the scaler (no scaler.step).
    found_inf_before_step: bool

    def next_backward_is_last(self) -> None: ...

    def scale_gradients_(self, factor: Any) -> None: ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...


@runtime_checkable
class InBackwardOptimizer(Protocol):
    """An optimizer whose parameters may step inside the window's last backward (``ComposedOptimizer``)."""

    steps_in_backward: bool
    # Stepping in backward, a non-finite gradient stops the parameters still to step (fused AdamW's device flag).
    guards_non_finite: bool
    # ``step()`` skips on a device flag (``found_inf``, as GradScaler hands it) with no host sync.
    takes_skip_flag: bool
    # The window's norm before clipping and its inf flag (device tensors), after ``step()``.
    last_grad_norm: torch.Tensor | None
    window_found_inf: torch.Tensor | None

    def prepare_backward(self, *, last: bool, grad_factor: Any = 1.0, max_norm: float | None = None,
                         scaler: Any = None) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class OptimizerTraits:
    """What the accumulator needs to know of an optimizer, read once when it is built.

    Attributes:
        steps_in_backward: parameters step inside the window's last backward.
        manages_gradients: the gradients live (partly) in host memory.
        found_inf_before_step: ``step()`` takes the fp16 overflow check from its host gradients.
        takes_skip_flag: ``step()`` skips on a device inf flag with no host sync (torch's fused Adam/AdamW, memtrain's
            AdamW whose every part is fused).
        announces_last_backward: ``next_backward_is_last()`` makes the last backward take the clip's norms.
        guards_non_finite: stepping in backward, a non-finite gradient stops the parameters still to step (fused
            AdamW's device flag); without it the parameter with that gradient may hold nan.
    """

    steps_in_backward: bool = False
    manages_gradients: bool = False
    found_inf_before_step: bool = False
    takes_skip_flag: bool = False
    announces_last_backward: bool = False
    guards_non_finite: bool = True

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerTraits:
        """The traits ``optimizer`` declares (``HostGradientOptimizer``, ``InBackwardOptimizer``), a plain one's
        for the rest."""
        traits: dict[str, bool] = {}
        if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            traits["takes_skip_flag"] = bool(optimizer.defaults.get("fused"))
        if isinstance(optimizer, HostGradientOptimizer):
            traits.update(manages_gradients=bool(optimizer.manages_gradients),
                          found_inf_before_step=bool(optimizer.found_inf_before_step), announces_last_backward=True)
        if isinstance(optimizer, InBackwardOptimizer):
            traits.update(steps_in_backward=bool(optimizer.steps_in_backward),
                          guards_non_finite=bool(optimizer.guards_non_finite),
                          takes_skip_flag=bool(optimizer.takes_skip_flag))
        return cls(**traits)
