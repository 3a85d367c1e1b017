"""Partial host offload: ComposedOptimizer's host part, a CPUOffloadOptimizer over the last parameters in registration
order (their gradients land first in backward), normalised, clipped and unscaled together with the device part.

Without step-in-backward the host gradients are the accumulator's path: ``scale_gradients_`` and
``clip_grad_norm_`` make no pass over them (the factor and the clip coefficient join the host step's multiplier).
"""

from __future__ import annotations

import torch

from memtrain.device import Accelerator
from memtrain.errors import MemtrainError
from memtrain.optim.host_buffers import Slot
from memtrain.optim.host_gradients import HostGradients
from memtrain.optim.offload import CPUOffloadOptimizer


class HostPart:
    """The gradients of one ComposedOptimizer split between the device and its host part (a CPUOffloadOptimizer):
    gathered once a step (landed on the host, the fp16 inverse scale handed over, the device ones unscaled and
    checked), then normalised and clipped together without a pass over the host ones.

    Args:
        host: the host part, or None (every parameter on the device).
        host_slots: the host part's slots (its parameters' host views), in its param_groups order.
        host_gradients: the host part's lazy multiplier (its ``HostGradients``), which the inverse scale and the
            clip coefficient join; None without a host part.
        device_params: the parameters on the device, in registration order.
        order: every parameter in param_groups order (the order torch stacks norms in).
        acc: the host part's device seam (``host.accelerator``), in whose ``host()`` region the inverse scale is
            made; None without a host part.
    """

    def __init__(self, *, host: CPUOffloadOptimizer | None, host_slots: list[Slot],
                 host_gradients: HostGradients | None, device_params: list[torch.Tensor], order: list[torch.Tensor],
                 acc: Accelerator | None):
        self.host, self.host_slots, self.host_gradients = host, host_slots, host_gradients
        self.acc = acc
        self.device_params, self.order = device_params, order
        self.gathered = False  # this step's gradients are gathered (see gather)
        self.device_found: torch.Tensor | None = None  # fp16: the device gradients' inf check

    def device_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.device_params if p.grad is not None]

    # The scaler is the owner's at each call (it may be attached after construction), and GradScaler keeps its
    # per-optimizer state under id(the owner): both are passed in.
    def gather(self, scaler: torch.amp.GradScaler | None, optimizer_id: int) -> None:
        """Makes this step's gradients ready: the host ones landed, the device ones unscaled and checked (fp16),
        the inverse scale joining the host step's multiplier."""
        if self.gathered:
            return
        if self.host is not None:
            self.host.gather_gradients()
        self.device_found = None
        if scaler is not None:
            state = scaler._per_optimizer_states[optimizer_id]
            if state["stage"].name == "UNSCALED":
                raise MemtrainError(
                    "scaler.unscale_(optimizer) was called, but part of this optimizer's gradients live on the host "
                    "where the scaler cannot see them. To resolve this error, remove scaler.unscale_(optimizer) and "
                    "call optimizer.clip_grad_norm_(max_norm), which unscales first (GradientAccumulator does).")
            inv = scaler._scale.double().reciprocal().float()
            found = torch.zeros((), dtype=torch.float32, device=inv.device)
            device_grads = self.device_grads()
            if device_grads:
                torch._amp_foreach_non_finite_check_and_unscale_(device_grads, found, inv)
            self.device_found = found
            if self.host is not None:
                # No pass over the host gradients: the inverse scale joins the host step's multiplier, and their
                # inf check is their norm's.
                with self.acc.host():  # a host value (the device seam's ledger must not count it)
                    self.host_gradients.inv_scale = inv.to("cpu", copy=True)
        self.gathered = True

    def all_grads(self) -> list[torch.Tensor]:
        """This step's gradients in param_groups order: device ones in .grad, host ones in the host buffers."""
        host = {id(s.device): s.master for s in self.host_slots} if self.host is not None else {}
        out = []
        for p in self.order:
            g = host[id(p)].grad if id(p) in host else p.grad
            if g is not None:
                out.append(g)
        return out

    def scale(self, factor: float | torch.Tensor) -> None:
        """Multiplies the gathered gradients by ``factor``: the device ones in place, the host ones lazily."""
        grads = self.device_grads()
        if grads and isinstance(factor, torch.Tensor):
            for device, group in _by_device(grads).items():
                torch._foreach_mul_(group, factor.to(device, torch.float32, non_blocking=True))
        elif grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)
        if self.host is not None:
            self.host.scale_gradients_(factor)

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gathered gradients (device and host) by their global norm; returns the norm before clipping
        (a CPU tensor). The host ones are not read: the coefficient joins the host step's multiplier."""
        if self.host is None or norm_type != 2.0:
            grads = self.all_grads()
            if self.host is not None:
                self.host.gradients()  # applies the host multiplier: this norm reads the gradients
            if not grads:
                return torch.zeros(())
            total = torch.nn.utils.get_total_norm(grads, norm_type).cpu()
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for device, group in _by_device(grads).items():
                torch._foreach_mul_(group, coef.to(device))
            return total
        host = {id(s.device): s for s in self.host_slots}
        host_total, multiplier, host_found = self.host_gradients.window_scalars()
        scale = multiplier.abs() if isinstance(multiplier, torch.Tensor) else abs(multiplier)
        device_grads = self.device_grads()
        # The device norms cross in one blocking copy per device: a non-blocking copy to the host returns before
        # its data arrives, and they are combined on the host right below.
        norm_of: dict[int, torch.Tensor] = {}
        for group in _by_device(device_grads).values():
            for g, norm in zip(group, torch.stack(torch._foreach_norm(group, 2.0)).cpu().unbind(), strict=True):
                norm_of[id(g)] = norm
        norms = []
        for p in self.order:  # param_groups order, as torch stacks them
            slot = host.get(id(p))
            if slot is None:
                if p.grad is not None:
                    norms.append(norm_of[id(p.grad)])
            elif slot.master.grad is not None:
                norm = slot.norm if slot.norm is not None else torch.linalg.vector_norm(slot.master.grad, 2.0)
                norms.append((norm.double() * scale).float() if isinstance(scale, torch.Tensor) else norm * scale)
        if not norms:
            return torch.zeros(())
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for device, group in _by_device(device_grads).items():
            torch._foreach_mul_(group, coef.to(device))
        self.host_gradients.scalars = (host_total, coef.double() * multiplier, torch.maximum(host_found,
                                                                                    (~total.isfinite()).float()))
        return total


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
