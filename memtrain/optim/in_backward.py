"""Step in backward: each device parameter steps as soon as its gradient is final, and the gradient is freed at once.

The whole model's gradients never coexist (4 bytes per parameter less at the backward's peak). One backward pass
per micro-batch: clipping uses the previous window's norm (lagged clipping), and an fp16 overflow stops the
parameters not yet stepped (see ``ComposedOptimizer``'s docstring in ``memtrain.optim.composed``).

The window ends with its backward: once the last gradient has landed, autograd's final callback steps what no hook
stepped (parameters used only in earlier micro-batches, the host part) and records the window's norm, the one that
clips the next window. ``step()`` after that changes no state (torchtune's optimizer-in-backward contract): it is the
boundary that reports the norm and the inf flag.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memtrain.errors import MemtrainError
from memtrain.optim.host_buffers import Slot
from memtrain.optim.offload import CPUOffloadOptimizer
from memtrain.precision import step_with_inf_flag


@dataclass
class Arming:
    """How the next backward treats the device gradients (step-in-backward)."""

    last: bool = True  # False: a non-final micro-batch, gradients accumulate as usual
    # Multiplies the (unscaled) gradients first: the window's normalisation; a device tensor from the accumulator
    # (1 / items, not read back).
    grad_factor: float | torch.Tensor = 1.0
    max_norm: float | None = None  # clip the global norm to this
    scaler: torch.amp.GradScaler | None = None
    finish_queued: bool = False  # a hook of this backward queued the window's end (autograd's final callback)
    finished: bool = False  # the window ended: everything stepped, its norm recorded; step() is next


@dataclass(frozen=True, eq=False)
class HyperparameterSync:
    """Copies the outer param group's hyper-parameters (the ones an LR scheduler writes) into the optimizers that
    step, before they step. Holds the outer group dict itself, never its optimizer, so that what holds a sync (the
    backward hooks' ``StepInBackward``) does not keep the optimizer alive."""

    group: dict[str, Any]  # the outer optimizer's param_groups[0], the live dict
    keys: tuple[str, ...]  # the hyper-parameters copied
    targets: tuple[torch.optim.Optimizer, ...]  # each inner optimizer once, and the host part

    def __call__(self) -> None:
        values = {k: self.group[k] for k in self.keys}
        for target in self.targets:
            for g in target.param_groups:
                g.update(values)


class StepInBackward:
    """Step-in-backward for one ComposedOptimizer: the arming of the next backward, this window's per-parameter
    norms and inf flags (on the device), the lagged norm that clips the next window, and whether a backward stepped
    since the last ``step()``. The backward hooks hold it (weakly) and step each device parameter through it.

    Args:
        inner: ``id(device parameter)`` -> the optimizer stepping it.
        names: ``id(parameter)`` -> its name (for errors).
        device_params: the parameters stepped on the device, in registration order.
        host: the host part (a CPUOffloadOptimizer), stepped at the window's end; None without one.
        host_slots: the host part's slots (its parameters' host views), in its param_groups order.
        order: every parameter in param_groups order (the order torch stacks norms in).
        sync: copies the outer hyper-parameters into ``inner`` and ``host``.
        scaler: the fp16 GradScaler the first backward is armed with (None: none).
    """

    def __init__(self, *, inner: dict[int, torch.optim.Optimizer], names: dict[int, str],
                 device_params: list[torch.Tensor], host: CPUOffloadOptimizer | None, host_slots: list[Slot],
                 order: list[torch.Tensor], sync: HyperparameterSync, scaler: torch.amp.GradScaler | None):
        self.inner, self.names, self.device_params, self.order = inner, names, device_params, order
        self.host, self.host_slots = host, host_slots
        self.sync = sync
        self.arming = Arming(scaler=scaler)
        self.backward_ran = False  # a backward stepped since the last step()
        self.synced = False  # the inner optimizers hold the outer hyper-parameters of this step
        self.norms: dict[int, torch.Tensor] = {}  # this window's per-parameter norms (device tensors)
        # The last finite window norm: it clips the next window (lagged clipping). 0 before any: no clipping.
        self.lagged_norm = torch.zeros(())
        # Per device, for one window's backward: the inf flag, the inverse scale and the clip coefficient, kept
        # on the device so that no hook synchronises with the host.
        self.on_device: dict[torch.device, dict[str, torch.Tensor]] = {}
        self.last_grad_norm: torch.Tensor | None = None  # the last window's norm before clipping
        self.window_found_inf: torch.Tensor | None = None  # the last window's inf/nan flag
        self.found_inf: torch.Tensor | None = None  # the last window's inf flag for the scaler (fp16)

    def prepare(self, *, last: bool, grad_factor: float | torch.Tensor, max_norm: float | None,
                scaler: torch.amp.GradScaler | None) -> None:
        """Arms the next backward (see ``ComposedOptimizer.prepare_backward``)."""
        self.sync()
        self.synced = True
        self.on_device.clear()
        factor = grad_factor if isinstance(grad_factor, torch.Tensor) else float(grad_factor)
        self.arming = Arming(last=last, grad_factor=factor,
                             max_norm=None if max_norm is None or max_norm == math.inf else float(max_norm),
                             scaler=scaler if scaler is not None and scaler.is_enabled() else None)

    def discard_window(self, scaler: torch.amp.GradScaler | None) -> None:
        """zero_grad(): a window dropped without step() (discard_window) leaves nothing behind; the next one starts
        afresh, armed with ``scaler`` (the owner's at this call)."""
        self.norms.clear()
        self.on_device.clear()
        if self.backward_ran:
            self.backward_ran = self.synced = False
            self.arming = Arming(scaler=scaler)

    def _inv_scale(self, scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
        return scaler._scale.double().reciprocal().float().to(device)  # as GradScaler.unscale_ computes it

    def _cached(self, device: torch.device, key: str) -> torch.Tensor:
        """Per device, for one window's backward: the inf flag, the inverse scale and the clip coefficient, made
        on the device once so that no hook synchronises with the host."""
        cache = self.on_device.setdefault(device, {})
        if key not in cache:
            if key == "found":
                cache[key] = torch.zeros((), dtype=torch.float32, device=device)
            elif key == "inv":
                cache[key] = self._inv_scale(self.arming.scaler, device)
            elif key == "factor":  # fp32, as a Python factor would be rounded for fp32 gradients
                # Blocking into host memory (the host gradients are multiplied right away); asynchronous onto a
                # device, where the multiply is queued behind the copy.
                cache[key] = self.arming.grad_factor.to(device, torch.float32, non_blocking=device.type != "cpu")
            else:  # "coef": lagged clipping, from the last finite window norm (0 before any: no clipping)
                lagged = self.lagged_norm.to(device, non_blocking=True)
                cache[key] = torch.clamp(self.arming.max_norm / (lagged + 1e-6), max=1.0)
        return cache[key]

    def _window_norm(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last backward: the global norm over device (from the hooks) and host gradients, in param order
        as torch's clip_grad_norm_ stacks them (another order can move the last bit), on the device; and the
        window's inf flag (None when nothing was checked)."""
        arming = self.arming
        host_found = None
        target = next(iter(self.norms.values())).device if self.norms else torch.device("cpu")
        host_norms: dict[int, torch.Tensor] = {}
        if self.host is not None:
            self.host.gather_gradients()
            landed = [s for s in self.host_slots if s.master.grad is not None]
            grads = [s.master.grad for s in landed]
            if grads and arming.scaler is not None:
                host_found = torch.zeros((), dtype=torch.float32)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, host_found,
                                                                 self._inv_scale(arming.scaler, grads[0].device))
            if grads:
                self._multiply_by_factor(grads)
                # One foreach pass and one copy for all the host norms: a norm and a copy per parameter cost
                # several microseconds each on the loop's thread.
                stacked = torch.stack(torch._foreach_norm(grads, 2.0)).to(target, non_blocking=True)
                host_norms = {id(s.device): n for s, n in zip(landed, stacked.unbind(), strict=True)}
        norms = []
        for p in self.order:
            if id(p) in host_norms:
                norms.append(host_norms[id(p)])
            elif id(p) in self.norms:
                norms.append(self.norms[id(p)].to(target, non_blocking=True))
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros((), device=target)
        flags = [c["found"].to(target, non_blocking=True) for c in self.on_device.values() if "found" in c]
        if host_found is not None:
            flags.append(host_found.to(target, non_blocking=True))
        found = torch.stack(flags).amax() if flags else None
        return total, found

    def _window_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as the step sees it, in place: unscaled (fp16), times the window's factor, in the
        accumulator's order of operations (the same kernels, so that the result is bit-identical to the ordinary
        path)."""
        arming = self.arming
        if arming.scaler is not None:
            torch._amp_foreach_non_finite_check_and_unscale_([grad], self._cached(grad.device, "found"),
                                                             self._cached(grad.device, "inv"))
        self._multiply_by_factor([grad])
        return grad

    def _multiply_by_factor(self, grads: list[torch.Tensor]) -> None:
        factor = self.arming.grad_factor
        if isinstance(factor, torch.Tensor):
            torch._foreach_mul_(grads, self._cached(grads[0].device, "factor"))
        elif factor != 1.0:
            torch._foreach_mul_(grads, factor)

    def step_param(self, p: torch.Tensor) -> None:
        """Unscale, normalise, take the norm, clip (lagged), step this parameter, free its gradient: one pass."""
        if not self.synced:
            self.sync()  # an LR scheduler stepped since: this backward steps with its lr
        grad = self._window_gradient(p.grad)
        norm = torch._foreach_norm([grad], 2.0)[0]
        self.norms[id(p)] = norm
        found = self._cached(grad.device, "found")
        # A non-finite gradient without a scaler is flagged too: no parameter steps after it (see the NOTE in
        # the class docstring), so weights never take nan from it. One scalar op, no host sync.
        torch.logical_or(found, norm.isfinite().logical_not(), out=found)
        if self.arming.max_norm is not None:
            torch._foreach_mul_([grad], self._cached(grad.device, "coef"))
        inner = self.inner[id(p)]
        step_with_inf_flag(inner, found if getattr(inner, "_step_supports_amp_scaling", False) else None)
        p.grad = None  # freed at once: the whole model's gradients never coexist
        self.backward_ran = True

    def _leftovers(self) -> list[torch.Tensor]:
        """Device parameters still holding a gradient after the last backward: no hook of it saw them (they were
        used only in earlier micro-batches of the window). They step at step(), like the rest."""
        return [p for p in self.device_params if p.grad is not None]

    def finish_window(self) -> None:
        """The window's end, once its last gradient has landed (autograd's final callback of the backward; step()
        where none ran): the leftovers and the host part step, and the window's norm is recorded, the one that
        clips the next window. Everything that changes state happens here, so that step() changes none."""
        arming = self.arming
        for p in self._leftovers():
            self.step_param(p)
        total, found = self._window_norm()
        self.last_grad_norm = total
        self.window_found_inf = found
        if self.host is not None:
            # NOTE: the host part steps after backward, so it can be clipped exactly and skipped on an inf: one
            # host sync (the norm and the flag in one copy), as the offloaded optimizer needs anyway.
            total_host, found_host = torch.stack([total, found if found is not None else torch.zeros_like(total)]
                                                 ).cpu().tolist()
            if found_host == 0 and math.isfinite(total_host):
                host_grads = [s.master.grad for s in self.host_slots if s.master.grad is not None]
                if arming.max_norm is not None and host_grads:
                    lagged = float(self.lagged_norm)
                    coef = min(1.0, arming.max_norm / (lagged + 1e-6))
                    if coef < 1.0:
                        torch._foreach_mul_(host_grads, coef)
                self.sync()
                self.host.step()
        # The norm that clips the next window: this one's when finite (a skipped window leaves it as it was).
        finite = total.isfinite() if found is None else total.isfinite() & (found == 0)
        self.lagged_norm = torch.where(finite, total, self.lagged_norm.to(total.device, non_blocking=True))
        if arming.scaler is not None:
            self.found_inf = found if found is not None else torch.zeros((), device=total.device)
        arming.finished = True

    def end_step(self, scaler: torch.amp.GradScaler | None) -> None:
        """step() of a step-in-backward optimizer: the boundary. The window ended with its backward (or ends
        here, where no final callback ran); the next backward starts a new one, armed with ``scaler`` (the
        owner's at this call: it may be attached after construction)."""
        if not self.backward_ran:
            raise MemtrainError(
                "step() on a step-in-backward optimizer with no backward since the last step(): the parameters step "
                "inside backward, so there is nothing to step. To resolve this error, call loss.backward() (or "
                "GradientAccumulator's micro-batches) before step().")
        if not self.arming.finished:
            self.finish_window()
        self.backward_ran = False
        self.synced = False
        self.norms.clear()
        self.on_device.clear()
        self.arming = Arming(scaler=scaler)  # the default: every backward steps (plain loops)

    def check_window_open(self, param: torch.Tensor) -> None:
        if self.arming.finished:
            raise MemtrainError(
                f"the gradient of {self.names[id(param)]!r} landed after its window had ended and before step(): "
                "a second backward without optimizer.step() between them, or reentrant checkpointing (one backward "
                "per block, each ending a window). To resolve this error, call optimizer.step() after each backward "
                "that steps (GradientAccumulator does) and checkpoint non-reentrantly (memtrain.apply_checkpointing, "
                "or torch.utils.checkpoint.checkpoint(..., use_reentrant=False)).")


def step_hook(owner: weakref.ref[StepInBackward]) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        self = owner()
        if self is None:
            return
        arming = self.arming
        if arming.last and param.grad is not None:
            self.check_window_open(param)
            with torch.no_grad():
                self.step_param(param)
            if not arming.finish_queued:
                arming.finish_queued = True
                # NOTE: autograd runs the queued callbacks when this backward ends, every gradient landed: no public
                # API says "the backward is over" (FSDP and DDP queue theirs the same way).
                torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_end_of_backward, owner))
    return hook


def _end_of_backward(owner: weakref.ref[StepInBackward]) -> None:
    self = owner()
    if self is not None:
        with torch.no_grad():
            self.finish_window()
