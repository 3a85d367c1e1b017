"""CPUOffloadOptimizer's host gradients: normalised, clipped and checked for inf/NaN with no pass over them.

``scale_gradients_`` and ``clip_grad_norm_`` only fold their factor and coefficient into the multiplier the host
step applies to each bucket; the global norm comes from the per-tensor norms the worker took as the gradients
landed (``memtrain.optim.gradient_landing``). ``gradients()`` is the one call that applies the multiplier now.
"""

from __future__ import annotations

import math

import torch

from memtrain.optim.host_buffers import Slot


class HostGradients:
    """The lazy multiplier over one CPUOffloadOptimizer's host gradients: the factors of ``scale_gradients_``, the
    fp16 inverse scale and, once clipped, the window's (norm, multiplier with the clip coefficient, inf flag). The
    host step applies the multiplier bucket by bucket; nothing here reads a gradient unless a norm is missing.

    Args:
        slots: the offloader's slots, in param_groups order (the order torch sums the norms in).
    """

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self.factor: float | torch.Tensor = 1.0  # the product of scale_gradients_'s factors
        self.inv_scale: torch.Tensor | None = None  # the fp16 inverse scale (a host tensor), this step's
        # (norm, multiplier with the clip coefficient, inf flag) once clip_grad_norm_ or the step made them.
        self.scalars: tuple[torch.Tensor, float | torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        """A new step: no factor, no inverse scale, no scalars."""
        self.factor, self.inv_scale, self.scalars = 1.0, None, None

    def landed(self) -> list[Slot]:
        return [s for s in self.slots if s.master.grad is not None]

    def apply(self) -> list[torch.Tensor]:
        """Applies the pending multiplier to the gradients now (one pass) and returns them, in param_groups order;
        their norms are dropped (the caller may change them)."""
        grads = [s.master.grad for s in self.landed()]
        multiplier = self.multiplier()
        if grads and (isinstance(multiplier, torch.Tensor) or multiplier != 1.0):
            torch._foreach_mul_(grads, multiplier)
        self.reset()
        for slot in self.slots:
            slot.norm = None
        return grads

    def scale(self, factor: float | torch.Tensor) -> None:
        """Folds ``factor`` into the multiplier (no pass over the gradients)."""
        if not isinstance(factor, torch.Tensor) and factor == 1.0:
            return
        self.factor = self.factor * factor
        self.scalars = None

    def multiplier(self) -> float | torch.Tensor:
        """What the host gradients are multiplied by before the step, clip coefficient aside: the factors of
        scale_gradients_ times the fp16 inverse scale."""
        multiplier = self.factor
        if self.inv_scale is not None:
            multiplier = self.inv_scale.double() * multiplier
        return multiplier

    def window_scalars(self, max_norm: float = math.inf) -> tuple[torch.Tensor, float | torch.Tensor, torch.Tensor]:
        """(global norm of the true gradients, multiplier with the clip coefficient, inf flag), host tensors made
        from the per-tensor norms the worker took as the gradients landed (one read of the gradients where some
        are missing); nothing is read back to Python."""
        landed = self.landed()
        if not landed:
            zero = torch.zeros(())
            return zero, self.multiplier(), zero
        if all(s.norm is not None for s in landed):
            # The per-tensor norms torch would take (linalg.vector_norm on CPU), taken during backward, summed in
            # param_groups order as torch sums the list it is given (another order can move the last bit).
            raw = torch.linalg.vector_norm(torch.stack([s.norm for s in landed]), 2.0)
        else:
            raw = torch.nn.utils.get_total_norm([s.master.grad for s in landed], 2.0)
        multiplier = self.multiplier()
        scale = multiplier.abs() if isinstance(multiplier, torch.Tensor) else abs(multiplier)
        total = (raw.double() * scale).float() if isinstance(scale, torch.Tensor) else raw * scale
        found = (~total.isfinite()).float()
        if max_norm != math.inf:
            # torch's coefficient, clamped at 1: a multiply by 1.0 changes nothing and costs nothing here.
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            multiplier = coef.double() * multiplier
        return total, multiplier, found

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Folds the clip coefficient into the multiplier; returns the total norm before clipping (a CPU tensor).
        The 2-norm comes from the per-tensor norms taken as the gradients landed; another reads the gradients."""
        if norm_type != 2.0:
            landed = self.landed()
            total = torch.nn.utils.get_total_norm([s.master.grad for s in landed], norm_type) if landed else \
                torch.zeros(())
            multiplier = self.multiplier()
            scale = multiplier.abs() if isinstance(multiplier, torch.Tensor) else abs(multiplier)
            total = total * scale
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self.scalars = (total, coef.double() * multiplier, (~total.isfinite()).float())
            return total
        self.scalars = self.window_scalars(max_norm)
        return self.scalars[0]

    def found_inf(self) -> torch.Tensor:
        """This step's inf/nan flag (a host tensor, 1.0 when the step will be skipped): a non-finite norm."""
        if self.scalars is None:
            self.scalars = self.window_scalars()
        return self.scalars[2]

    def for_step(self) -> tuple[float | torch.Tensor, torch.Tensor | None]:
        """The multiplier the host step applies and its inf flag (None: nothing checked)."""
        if self.scalars is None and self.inv_scale is not None:
            self.scalars = self.window_scalars()  # an fp16 step needs the inf check: the norm's
        if self.scalars is not None:
            return self.scalars[1], self.scalars[2]
        return self.multiplier(), None
