"""CPUOffloadOptimizer's host gradients: normalised, clipped and checked for inf/NaN with no pass over them.

``scale_gradients_`` and ``clip_grad_norm_`` only fold their factor and coefficient into the multiplier the host
step applies to each bucket; the global norm comes from the per-tensor norms the worker took as the gradients
landed (``memtrain.optim.gradient_landing``). ``gradients()`` is the one call that applies the multiplier now.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from memtrain.errors import MemtrainError
from memtrain.optim.host_buffers import Slot, host_work


class HostGradients:
    """CPUOffloadOptimizer's gradient methods (a mixin: the attributes it reads are set up by
    ``CPUOffloadOptimizer.__init__``)."""

    if TYPE_CHECKING:
        _acc: Any
        _slots: list[Slot]
        _gathered: bool
        _waiting: list[set[int]] | None
        _norms_on_first_landing: bool
        _grad_factor: float | torch.Tensor
        _inv_scale: torch.Tensor | None
        _scalars: tuple[torch.Tensor, float | torch.Tensor, torch.Tensor] | None

        def _gather(self) -> None: ...

    @host_work
    def gradients(self) -> list[torch.Tensor]:
        """This step's host gradients (landed, unscaled, normalised by ``scale_gradients_``), in param_groups
        order, for in-place edits.

        For code that must change gradients before the step (e.g. normalising an accumulated sum by the token
        count): ``[p.grad for p in model.parameters()]`` finds nothing once gradients are offloaded. This applies
        the pending multiplier (one pass; ``scale_gradients_`` and ``clip_grad_norm_`` make none).
        """
        self._gather()
        grads = [s.master.grad for s in self._slots if s.master.grad is not None]
        multiplier = self._multiplier()
        if grads and (isinstance(multiplier, torch.Tensor) or multiplier != 1.0):
            torch._foreach_mul_(grads, multiplier)
        self._grad_factor, self._inv_scale, self._scalars = 1.0, None, None
        for slot in self._slots:
            slot.norm = None  # the caller may change them
        return grads

    @torch.no_grad()
    @host_work
    def scale_gradients_(self, factor: float | torch.Tensor) -> None:
        """Multiplies this step's host gradients by ``factor`` (e.g. one over the items in the window), lazily.

        No pass over the gradients: the factor joins the multiplier that the host step applies as it reads each
        gradient (fused AdamW's ``grad_scale``; other classes get one multiply per bucket inside the step), and
        the per-tensor norms the worker took as the gradients landed are scaled by ``|factor|``, so
        ``clip_grad_norm_`` reads no gradient either: on a 1.1B model each of those passes reads 4.4 GB on the
        critical path of the step. The price: ``|factor| * norm`` can differ from the norm of the scaled gradient
        in its last bit, and dividing by the multiplier's inverse from multiplying, so a step equals torch's
        within float rounding rather than bit for bit (``pytest tests/test_optim_offload.py`` checks 1e-6).

        Args:
            factor: multiplies every gradient (dimensionless; negative flips the sign, the norms keep theirs); a
                0-d CPU tensor too.

        Raises:
            MemtrainError: after ``step_in_next_backward()``: buckets were already stepped with these gradients.
        """
        if self._waiting is not None:
            raise MemtrainError(
                "scale_gradients_ after step_in_next_backward(): buckets were already stepped (or are stepping) with "
                "these gradients, so scaling them now changes nothing in this update. To resolve this error, drop "
                "step_in_next_backward() when gradients need normalising (e.g. accumulation over token counts).")
        self._gather()
        if not isinstance(factor, torch.Tensor) and factor == 1.0:
            return
        self._grad_factor = self._grad_factor * factor
        self._scalars = None

    def _multiplier(self) -> float | torch.Tensor:
        """What the host gradients are multiplied by before the step, clip coefficient aside: the factors of
        scale_gradients_ times the fp16 inverse scale."""
        multiplier = self._grad_factor
        if self._inv_scale is not None:
            multiplier = self._inv_scale.double() * multiplier
        return multiplier

    def _window_scalars(self, max_norm: float = math.inf) -> tuple[torch.Tensor, float | torch.Tensor, torch.Tensor]:
        """(global norm of the true gradients, multiplier with the clip coefficient, inf flag), host tensors made
        from the per-tensor norms the worker took as the gradients landed (one read of the gradients where some
        are missing); nothing is read back to Python."""
        landed = [s for s in self._slots if s.master.grad is not None]
        if not landed:
            zero = torch.zeros(())
            return zero, self._multiplier(), zero
        if all(s.norm is not None for s in landed):
            # The per-tensor norms torch would take (linalg.vector_norm on CPU), taken during backward, summed in
            # param_groups order as torch sums the list it is given (another order can move the last bit).
            raw = torch.linalg.vector_norm(torch.stack([s.norm for s in landed]), 2.0)
        else:
            raw = torch.nn.utils.get_total_norm([s.master.grad for s in landed], 2.0)
        multiplier = self._multiplier()
        scale = multiplier.abs() if isinstance(multiplier, torch.Tensor) else abs(multiplier)
        total = (raw.double() * scale).float() if isinstance(scale, torch.Tensor) else raw * scale
        found = (~total.isfinite()).float()
        if max_norm != math.inf:
            # torch's coefficient, clamped at 1: a multiply by 1.0 changes nothing and costs nothing here.
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            multiplier = coef.double() * multiplier
        return total, multiplier, found

    @torch.no_grad()
    @host_work
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` would on the device.

        The gradients live on the host, where ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` cannot
        see them (it would find none and clip nothing): call this instead, after backward and before ``step()``.
        With a grad_scaler attached the norm is that of the unscaled gradients. The coefficient joins the
        multiplier the host step applies (no pass over the gradients, no host sync); the norm comes from the
        per-tensor norms taken as the gradients landed.

        Returns:
            The total norm before clipping (a CPU tensor; inf or NaN when the step will be skipped).
        """
        if self._waiting is not None:
            raise MemtrainError(
                "clip_grad_norm_ after step_in_next_backward(): buckets were already stepped with unclipped gradients "
                "during backward. To resolve this error, drop step_in_next_backward() when clipping (or use "
                "delayed_update=True to hide the CPU step).")
        self._gather()
        landed = [s for s in self._slots if s.master.grad is not None]
        # A window of one backward: from now on the worker takes the norm of each first landing (the last one,
        # in such loops).
        self._norms_on_first_landing = bool(landed) and all(s.landings == 1 for s in landed)
        if norm_type != 2.0:
            total = torch.nn.utils.get_total_norm([s.master.grad for s in landed], norm_type) if landed else \
                torch.zeros(())
            multiplier = self._multiplier()
            scale = multiplier.abs() if isinstance(multiplier, torch.Tensor) else abs(multiplier)
            total = total * scale
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self._scalars = (total, coef.double() * multiplier, (~total.isfinite()).float())
            return total
        self._scalars = self._window_scalars(max_norm)
        return self._scalars[0]

    @property
    def found_inf_flag(self) -> torch.Tensor | None:
        """This step's inf/nan flag (a host tensor, 1.0 when the step will be skipped), once the gradients are
        gathered (``clip_grad_norm_`` or ``step``): a non-finite norm, which an fp16 overflow gives."""
        if not self._gathered:
            return None
        if self._scalars is None:
            self._scalars = self._window_scalars()
        return self._scalars[2]
