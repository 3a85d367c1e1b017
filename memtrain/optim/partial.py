"""Partial host offload: ComposedOptimizer's host part, a CPUOffloadOptimizer over the last parameters in registration
order (their gradients land first in backward), normalised, clipped and unscaled together with the device part.

Without step-in-backward the host gradients are the accumulator's path: ``scale_gradients_`` and
``clip_grad_norm_`` make no pass over them (the factor and the clip coefficient join the host step's multiplier).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memtrain.errors import MemtrainError


class HostPart:
    """ComposedOptimizer's methods for gradients split between the device and the host part (a mixin: the attributes it
    reads are set up by ``ComposedOptimizer.__init__``)."""

    if TYPE_CHECKING:
        param_groups: list[dict[str, Any]]
        steps_in_backward: bool
        grad_scaler: torch.amp.GradScaler | None
        _host: Any
        _device_params: list[torch.Tensor]
        _gathered: bool
        _found_inf: torch.Tensor | None
        _device_found: torch.Tensor | None

    def _device_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._device_params if p.grad is not None]

    # -- host gradients: normalise, clip, unscale (the accumulator's path for CPUOffloadOptimizer) ---------------
    def _gather(self) -> None:
        if self._gathered:
            return
        if self._host is not None:
            self._host._gather()
        self._found_inf = None
        self._device_found = None
        if self.grad_scaler is not None and not self.steps_in_backward:
            state = self.grad_scaler._per_optimizer_states[id(self)]
            if state["stage"].name == "UNSCALED":
                raise MemtrainError(
                    "scaler.unscale_(optimizer) was called, but part of this optimizer's gradients live on the host "
                    "where the scaler cannot see them. To resolve this error, remove scaler.unscale_(optimizer) and "
                    "call optimizer.clip_grad_norm_(max_norm), which unscales first (GradientAccumulator does).")
            inv = self.grad_scaler._scale.double().reciprocal().float()
            found = torch.zeros((), dtype=torch.float32, device=inv.device)
            device_grads = self._device_grads()
            if device_grads:
                torch._amp_foreach_non_finite_check_and_unscale_(device_grads, found, inv)
            self._device_found = found
            if self._host is not None:
                # No pass over the host gradients: the inverse scale joins the host step's multiplier, and their
                # inf check is their norm's.
                with self._host._acc.host():  # a host value (the device seam's ledger must not count it)
                    self._host._inv_scale = inv.to("cpu", copy=True)
        self._gathered = True

    def _all_grads(self) -> list[torch.Tensor]:
        """This step's gradients in param_groups order: device ones in .grad, host ones in the host buffers."""
        host = {id(s.device): s.master for s in self._host._slots} if self._host is not None else {}
        out = []
        for p in self.param_groups[0]["params"]:
            g = host[id(p)].grad if id(p) in host else p.grad
            if g is not None:
                out.append(g)
        return out

    def next_backward_is_last(self) -> None:
        """The host part takes each gradient's norm as it lands in the next backward (the window's last), so that
        ``clip_grad_norm_`` reads no host gradient (see ``CPUOffloadOptimizer.next_backward_is_last``)."""
        if self._host is not None:
            self._host.next_backward_is_last()

    @torch.no_grad()
    def scale_gradients_(self, factor: float | torch.Tensor) -> None:
        """Multiplies this step's gradients by ``factor`` (a number, or a one-element host tensor: not read): the
        device ones in place, the host ones lazily (the host step applies it, see
        ``CPUOffloadOptimizer.scale_gradients_``)."""
        self._check_not_in_backward("scale_gradients_")
        self._gather()
        grads = self._device_grads()
        if grads and isinstance(factor, torch.Tensor):
            for device, group in _by_device(grads).items():
                torch._foreach_mul_(group, factor.to(device, torch.float32, non_blocking=True))
        elif grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)
        if self._host is not None:
            self._host.scale_gradients_(factor)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients (device and host) by their global norm, as ``torch.nn.utils.clip_grad_norm_``
        would if all of them were on the device; returns the norm before clipping (a CPU tensor). The host
        gradients are not read: their norms were taken as they landed, and the coefficient joins the host step's
        multiplier."""
        self._check_not_in_backward("clip_grad_norm_")
        self._gather()
        if self._host is None or norm_type != 2.0:
            grads = self._all_grads()
            if self._host is not None:
                self._host.gradients()  # applies the host multiplier: this norm reads the gradients
            if not grads:
                return torch.zeros(())
            total = torch.nn.utils.get_total_norm(grads, norm_type).cpu()
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for device, group in _by_device(grads).items():
                torch._foreach_mul_(group, coef.to(device))
            return total
        host = {id(s.device): s for s in self._host._slots}
        host_total, multiplier, host_found = self._host._window_scalars()
        scale = multiplier.abs() if isinstance(multiplier, torch.Tensor) else abs(multiplier)
        device_grads = self._device_grads()
        # The device norms cross in one blocking copy per device: a non-blocking copy to the host returns before
        # its data arrives, and they are combined on the host right below.
        norm_of: dict[int, torch.Tensor] = {}
        for group in _by_device(device_grads).values():
            for g, norm in zip(group, torch.stack(torch._foreach_norm(group, 2.0)).cpu().unbind(), strict=True):
                norm_of[id(g)] = norm
        norms = []
        for p in self.param_groups[0]["params"]:  # param_groups order, as torch stacks them
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
        self._host._scalars = (host_total, coef.double() * multiplier, torch.maximum(host_found,
                                                                                    (~total.isfinite()).float()))
        return total

    def _check_not_in_backward(self, what: str) -> None:
        if self.steps_in_backward:
            raise MemtrainError(
                f"{what} on a step-in-backward optimizer: the device parameters stepped during backward, so there "
                "is no gradient left to change. To resolve this error, pass the normalisation and the clipping "
                "before backward: GradientAccumulator(..., max_grad_norm=...) does it, or call "
                "optimizer.prepare_backward(grad_factor=..., max_norm=...) and optimizer.backward(loss).")


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
