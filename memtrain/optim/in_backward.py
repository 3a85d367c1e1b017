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
from typing import TYPE_CHECKING, Any

import torch

from memtrain.errors import MemtrainError
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


class StepInBackward:
    """ComposedOptimizer's step-in-backward methods (a mixin: the attributes it reads are set up by ``ComposedOptimizer.__init__``)."""

    if TYPE_CHECKING:
        param_groups: list[dict[str, Any]]
        steps_in_backward: bool
        grad_scaler: torch.amp.GradScaler | None
        last_grad_norm: torch.Tensor | None
        window_found_inf: torch.Tensor | None
        _host: Any
        _inner: dict[int, torch.optim.Optimizer]
        _names: dict[int, str]
        _device_params: list[torch.Tensor]
        _arming: Arming
        _synced: bool
        _on_device: dict[torch.device, dict[str, torch.Tensor]]
        _norms: dict[int, torch.Tensor]
        _lagged_norm: torch.Tensor
        _backward_ran: bool
        _found_inf: torch.Tensor | None

        def _sync_hyperparameters(self) -> None: ...

    # -- step-in-backward ---------------------------------------------------------------------------------------
    def prepare_backward(self, *, last: bool = True, grad_factor: float = 1.0, max_norm: float | None = None,
                         scaler: torch.amp.GradScaler | None = None) -> None:
        """Arms the next backward (step-in-backward only).

        Args:
            last: False for a micro-batch that is not the window's last: its gradients accumulate as usual.
            grad_factor: multiplies the unscaled gradients before clipping and stepping (e.g. 1 / items): a
                number, or a 0-d tensor (never read on the host).
            max_norm: clip with the coefficient of the *previous* window's norm (lagged clipping, see the class
                docstring); this window's norm is taken as its gradients step and clips the next one.
            scaler: the fp16 GradScaler whose scale the gradients carry: each is unscaled and checked as it
                lands, and no parameter steps once an inf/nan was seen.
        """
        if not self.steps_in_backward:
            raise MemtrainError("prepare_backward() on an optimizer built with step_in_backward=False: its step() "
                                "does the work. To resolve this error, build it with step_in_backward=True or drop "
                                "the call.")
        self._sync_hyperparameters()
        self._synced = True
        self._on_device.clear()
        factor = grad_factor if isinstance(grad_factor, torch.Tensor) else float(grad_factor)
        self._arming = Arming(last=last, grad_factor=factor,
                               max_norm=None if max_norm is None or max_norm == math.inf else float(max_norm),
                               scaler=scaler if scaler is not None and scaler.is_enabled() else None)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagates ``loss`` as armed: one pass, the parameters stepping as their gradients are final.

        Kept so that callers need not know the arming: it is ``loss.backward()``.
        """
        loss.backward()

    def _inv_scale(self, scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
        return scaler._scale.double().reciprocal().float().to(device)  # as GradScaler.unscale_ computes it

    def _cached(self, device: torch.device, key: str) -> torch.Tensor:
        """Per device, for one window's backward: the inf flag, the inverse scale and the clip coefficient, made
        on the device once so that no hook synchronises with the host."""
        cache = self._on_device.setdefault(device, {})
        if key not in cache:
            if key == "found":
                cache[key] = torch.zeros((), dtype=torch.float32, device=device)
            elif key == "inv":
                cache[key] = self._inv_scale(self._arming.scaler, device)
            elif key == "factor":  # fp32, as a Python factor would be rounded for fp32 gradients
                # Blocking into host memory (the host gradients are multiplied right away); asynchronous onto a
                # device, where the multiply is queued behind the copy.
                cache[key] = self._arming.grad_factor.to(device, torch.float32, non_blocking=device.type != "cpu")
            else:  # "coef": lagged clipping, from the last finite window norm (0 before any: no clipping)
                lagged = self._lagged_norm.to(device, non_blocking=True)
                cache[key] = torch.clamp(self._arming.max_norm / (lagged + 1e-6), max=1.0)
        return cache[key]

    def _window_norm(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last backward: the global norm over device (from the hooks) and host gradients, in param order
        as torch's clip_grad_norm_ stacks them (another order can move the last bit), on the device; and the
        window's inf flag (None when nothing was checked)."""
        arming = self._arming
        host_found = None
        target = next(iter(self._norms.values())).device if self._norms else torch.device("cpu")
        host_norms: dict[int, torch.Tensor] = {}
        if self._host is not None:
            self._host._gather()
            landed = [s for s in self._host._slots if s.master.grad is not None]
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
        for p in self.param_groups[0]["params"]:
            if id(p) in host_norms:
                norms.append(host_norms[id(p)])
            elif id(p) in self._norms:
                norms.append(self._norms[id(p)].to(target, non_blocking=True))
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros((), device=target)
        flags = [c["found"].to(target, non_blocking=True) for c in self._on_device.values() if "found" in c]
        if host_found is not None:
            flags.append(host_found.to(target, non_blocking=True))
        found = torch.stack(flags).amax() if flags else None
        return total, found

    def _window_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as the step sees it, in place: unscaled (fp16), times the window's factor, in the
        accumulator's order of operations (the same kernels, so that the result is bit-identical to the ordinary
        path)."""
        arming = self._arming
        if arming.scaler is not None:
            torch._amp_foreach_non_finite_check_and_unscale_([grad], self._cached(grad.device, "found"),
                                                             self._cached(grad.device, "inv"))
        self._multiply_by_factor([grad])
        return grad

    def _multiply_by_factor(self, grads: list[torch.Tensor]) -> None:
        factor = self._arming.grad_factor
        if isinstance(factor, torch.Tensor):
            torch._foreach_mul_(grads, self._cached(grads[0].device, "factor"))
        elif factor != 1.0:
            torch._foreach_mul_(grads, factor)

    def _step_param(self, p: torch.Tensor) -> None:
        """Unscale, normalise, take the norm, clip (lagged), step this parameter, free its gradient: one pass."""
        if not self._synced:
            self._sync_hyperparameters()  # an LR scheduler stepped since: this backward steps with its lr
        grad = self._window_gradient(p.grad)
        norm = torch._foreach_norm([grad], 2.0)[0]
        self._norms[id(p)] = norm
        found = self._cached(grad.device, "found")
        # A non-finite gradient without a scaler is flagged too: no parameter steps after it (see the NOTE in
        # the class docstring), so weights never take nan from it. One scalar op, no host sync.
        torch.logical_or(found, norm.isfinite().logical_not(), out=found)
        if self._arming.max_norm is not None:
            torch._foreach_mul_([grad], self._cached(grad.device, "coef"))
        inner = self._inner[id(p)]
        step_with_inf_flag(inner, found if getattr(inner, "_step_supports_amp_scaling", False) else None)
        p.grad = None  # freed at once: the whole model's gradients never coexist
        self._backward_ran = True

    def _leftovers(self) -> list[torch.Tensor]:
        """Device parameters still holding a gradient after the last backward: no hook of it saw them (they were
        used only in earlier micro-batches of the window). They step at step(), like the rest."""
        return [p for p in self._device_params if p.grad is not None]

    def _finish_window(self) -> None:
        """The window's end, once its last gradient has landed (autograd's final callback of the backward; step()
        where none ran): the leftovers and the host part step, and the window's norm is recorded, the one that
        clips the next window. Everything that changes state happens here, so that step() changes none."""
        arming = self._arming
        for p in self._leftovers():
            self._step_param(p)
        total, found = self._window_norm()
        self.last_grad_norm = total
        self.window_found_inf = found
        if self._host is not None:
            # NOTE: the host part steps after backward, so it can be clipped exactly and skipped on an inf: one
            # host sync (the norm and the flag in one copy), as the offloaded optimizer needs anyway.
            total_host, found_host = torch.stack([total, found if found is not None else torch.zeros_like(total)]
                                                 ).cpu().tolist()
            if found_host == 0 and math.isfinite(total_host):
                host_grads = [s.master.grad for s in self._host._slots if s.master.grad is not None]
                if arming.max_norm is not None and host_grads:
                    lagged = float(self._lagged_norm)
                    coef = min(1.0, arming.max_norm / (lagged + 1e-6))
                    if coef < 1.0:
                        torch._foreach_mul_(host_grads, coef)
                self._sync_hyperparameters()
                self._host.step()
        # The norm that clips the next window: this one's when finite (a skipped window leaves it as it was).
        finite = total.isfinite() if found is None else total.isfinite() & (found == 0)
        self._lagged_norm = torch.where(finite, total, self._lagged_norm.to(total.device, non_blocking=True))
        if arming.scaler is not None:
            self._found_inf = found if found is not None else torch.zeros((), device=total.device)
        arming.finished = True

    def _step_after_backward(self) -> None:
        """step() of a step-in-backward optimizer: the boundary. The window ended with its backward (or ends
        here, where no final callback ran); the next backward starts a new one."""
        if not self._backward_ran:
            raise MemtrainError(
                "step() on a step-in-backward optimizer with no backward since the last step(): the parameters step "
                "inside backward, so there is nothing to step. To resolve this error, call loss.backward() (or "
                "GradientAccumulator's micro-batches) before step().")
        if not self._arming.finished:
            self._finish_window()
        self._backward_ran = False
        self._synced = False
        self._norms.clear()
        self._on_device.clear()
        self._arming = Arming(scaler=self.grad_scaler)  # the default: every backward steps (plain loops)

    def _check_window_open(self, param: torch.Tensor) -> None:
        if self._arming.finished:
            raise MemtrainError(
                f"the gradient of {self._names[id(param)]!r} landed after its window had ended and before step(): "
                "a second backward without optimizer.step() between them, or reentrant checkpointing (one backward "
                "per block, each ending a window). To resolve this error, call optimizer.step() after each backward "
                "that steps (GradientAccumulator does) and checkpoint non-reentrantly (memtrain.apply_checkpointing, "
                "or torch.utils.checkpoint.checkpoint(..., use_reentrant=False)).")


def step_hook(owner: weakref.ref[StepInBackward]) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        self = owner()
        if self is None:
            return
        arming = self._arming
        if arming.last and param.grad is not None:
            self._check_window_open(param)
            with torch.no_grad():
                self._step_param(param)
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
            self._finish_window()
