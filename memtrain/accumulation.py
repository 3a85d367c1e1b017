"""Gradient accumulation with an explicit stepping boundary and token-count-correct normalisation.

Runs several small micro-batches per optimizer step: activation memory of one micro-batch, the gradient of the
whole window, at the cost of less parallelism per kernel. Made exact where common tools are not:

- Sum-reduced losses are normalised by the total number of items (tokens, examples) in the window, summed over
  ranks, so 4 micro-batches of 2 variable-length sequences give the gradient of one batch of 8 (dividing each
  micro-batch's mean by 4 does not: transformers #37766).
- Mean-reduced losses are divided by the *actual* number of micro-batches, so a partial last window (end of the
  data) is not scaled by the full window's size.
- Gradients are synchronised once per window: DDP's ``no_sync()`` spans the forward and the backward of every
  micro-batch but the last; FSDP2 gets ``set_requires_gradient_sync(False)`` (its modules have no ``no_sync``).
- ``step()`` is the only place the optimizer steps, and it always does (or, for an fp16 overflow, reports
  that it skipped): unscale -> normalise -> clip -> optimizer step -> scaler update -> scheduler step ->
  ``zero_grad(set_to_none=True)``.

How the normalisation is done: each micro-batch calls ``backward`` on its loss as given, so gradients hold the
*sum* over the window; at the boundary one small all-reduce adds up the items (and the micro-batches and the
loss, for the log) of every rank, and every gradient is multiplied once by ``world_size / total_items``
(``world_size`` undoes the average that DDP and FSDP2 take across ranks). The multiply happens after the fp16
unscale, on true gradients, and before clipping, so the clipped norm is the norm of the full-batch gradient.
With an fp16 scaler, sum-reduced losses are multiplied by a constant ``1 / items`` of the first micro-batch
seen (the same on every rank) before backward, so scaled gradients have a mean loss's magnitude and do not
overflow fp16 (without it, the first step of the tests' GPT overflows at the default scale of 65536); the
boundary multiply divides it out again.

Ranks may run different numbers of micro-batches in a window under DDP (a ``no_sync`` forward and backward do
not communicate, for models without buffers to broadcast); FSDP2 all-gathers parameters in every forward, so
there every rank must run as many micro-batches as the others or the ranks deadlock.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from memtrain.device import accelerator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.message import arg
from memtrain.optim.contract import OptimizerTraits
from memtrain.precision import step_with_inf_flag
from memtrain.unwrap import is_fsdp2, unwrap_model

Reduction = Literal["sum", "mean"]

_FIX_WINDOW = ("To resolve this error, run each micro-batch as `with acc.micro_batch(is_last=...): loss = ...; "
               "acc.backward(loss, reduction=..., items=...)` and end the window with `acc.step()`.")


class StepResult:
    """What one optimizer-step boundary did.

    Attributes:
        step: optimizer steps taken so far, this one included (skipped steps are not counted).
        loss: the window's loss normalised like the full batch: sum of losses / items (sum-reduced) or the mean
            of the micro-batch means (mean-reduced), over every rank.
        grad_norm: global L2 norm of the normalised gradient before clipping (inf or nan when skipped).
        skipped: True when the step was skipped: the fp16 scaler found an inf/nan gradient, or (without clipping
            and scaler, see ``GradientAccumulator``) the device-side check found a non-finite gradient.
        items: items in the window summed over ranks (0 for mean-reduced losses given without items).
        micro_batches: micro-batches in the window on this rank.

    ``loss``, ``grad_norm``, ``skipped`` and ``items`` may still live on the device: the first of them read makes
    the one host sync (log every N steps to keep the loop free of syncs).
    """

    def __init__(self, *, step: int, micro_batches: int, loss: float | None = None, grad_norm: float | None = None,
                 skipped: bool | None = None, items: int | None = None, on_device: torch.Tensor | None = None):
        self.step = step
        self.micro_batches = micro_batches
        # [loss, grad_norm, skipped, items] as a device tensor until read, then as Python numbers.
        self._values: Any = on_device if on_device is not None else (loss, grad_norm, skipped, items)

    def _value(self, i: int) -> Any:
        if isinstance(self._values, torch.Tensor):
            self._values = tuple(self._values.tolist())  # the reader's host sync, once
        return self._values[i]

    @property
    def loss(self) -> float:
        return float(self._value(0))

    @property
    def grad_norm(self) -> float:
        return float(self._value(1))

    @property
    def skipped(self) -> bool:
        return bool(self._value(2))

    @property
    def items(self) -> int:
        return int(round(self._value(3)))

    def __repr__(self) -> str:
        return (f"StepResult(step={self.step}, loss={self.loss}, grad_norm={self.grad_norm}, skipped={self.skipped}, "
                f"items={self.items}, micro_batches={self.micro_batches})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepResult) and repr(self) == repr(other)

    __hash__ = None  # type: ignore[assignment]


def accumulation_steps(micro_batch_size: int, global_batch_size: int, world_size: int = 1) -> int:
    """Micro-batches per optimizer step so that ``global_batch_size`` examples make one step on ``world_size`` ranks.

    Raises:
        ConfigError: a size below 1, or a global batch that is not a multiple of micro-batch x world size.

    Example:
        >>> accumulation_steps(2, 8)
        4
    """
    problems = []
    for name, value in (("micro_batch_size", micro_batch_size), ("global_batch_size", global_batch_size),
                        ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{arg(name, value)} must be an integer >= 1. To resolve this error, pass a whole number "
                             f"of examples, e.g. {arg(name, 8)}.")
    ConfigError.raise_if(problems)
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        below = max(per_step, global_batch_size // per_step * per_step)
        by = (f"{arg('micro_batch_size', micro_batch_size)} x {arg('world_size', world_size)} = {per_step}"
              if world_size > 1 else arg("micro_batch_size", micro_batch_size))  # one process: no ranks to name
        raise ConfigError(
            f"{arg('global_batch_size', global_batch_size)} is not divisible by {by}: "
            "accumulation needs a whole number of micro-batches per step. To resolve this error, pass "
            f"{arg('global_batch_size', below)} or {below + per_step}, or a {arg('micro_batch_size')} that divides "
            "it."
        )
    return global_batch_size // per_step


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sync_kind(model: nn.Module) -> Literal["fsdp2", "no_sync", "none"]:
    if is_fsdp2(model):
        return "fsdp2"  # its modules have no no_sync(): set_requires_gradient_sync instead
    if callable(getattr(unwrap_model(model, ddp=False), "no_sync", None)):
        return "no_sync"  # DDP (and FSDP1)
    return "none"


class GradientAccumulator:
    """Accumulates gradients over a window of micro-batches and steps the optimizer once at an explicit boundary.

    Memory of one micro-batch's activations for the gradient of the whole window, at the cost of smaller
    kernels; under DDP/FSDP2 gradients are communicated once per window, not once per micro-batch.

    Args:
        model: the module being trained; a ``DistributedDataParallel`` or FSDP2 (``fully_shard``) module when
            torch.distributed runs more than one rank, so its gradient sync can be skipped.
        optimizer: steps the parameters; its parameters' gradients are normalised and clipped.
        steps: micro-batches in a full window (a partial last window may hold fewer).
        scaler: the fp16 GradScaler (``MixedPrecision("fp16-mixed", ...).scaler``), or None.
        scheduler: an LR scheduler stepped once per optimizer step actually taken, or None.
        max_grad_norm: clip the global gradient norm to this value; None computes the norm without clipping.

    Raises:
        ConfigError: bad arguments (listed together).

    Example:
        >>> model = nn.Linear(4, 1)
        >>> acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        >>> batches = [torch.randn(3, 4), torch.randn(5, 4)]
        >>> for i, x in enumerate(batches):
        ...     with acc.micro_batch(is_last=i == len(batches) - 1):
        ...         acc.backward(model(x).pow(2).sum(), reduction="sum", items=len(x))
        >>> result = acc.step()
        >>> result.step, result.items, result.micro_batches
        (1, 8, 2)
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, steps: int,
                 scaler: torch.amp.GradScaler | None = None, scheduler: Any = None,
                 max_grad_norm: float | None = None):
        problems = []
        if not isinstance(model, nn.Module):
            problems.append(f"model is a {type(model).__name__}, not an nn.Module. To resolve this error, pass the "
                            "model being trained (wrapped in DDP/FSDP where it is).")
        if not isinstance(optimizer, torch.optim.Optimizer):
            problems.append(f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer. To resolve this "
                            "error, pass the optimizer that steps the model's parameters.")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            problems.append(f"accumulation steps={steps!r} must be an integer >= 1 (1 means no accumulation). To "
                            "resolve this error, pass steps=accumulation_steps(micro_batch_size, global_batch_size, "
                            "world_size).")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
            problems.append(f"{arg('max_grad_norm', max_grad_norm)} must be a finite number > 0, or None for no "
                            f"clipping. To resolve this error, pass e.g. {arg('max_grad_norm', 1.0)}.")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            problems.append(f"scaler is a {type(scaler).__name__}, not a torch.amp.GradScaler. To resolve this "
                            "error, pass torch.amp.GradScaler() (fp16 only) or None.")
        elif scaler is not None and scaler.is_enabled() and not scaler.get_backoff_factor() < 1:
            # A skipped step is recognised by the scale going down; see step().
            problems.append(f"GradScaler backoff_factor={scaler.get_backoff_factor()} must be < 1 (a skipped step is "
                            "seen as the scale going down). To resolve this error, keep the default 0.5.")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            problems.append(f"scheduler is a {type(scheduler).__name__} with no step() method. To resolve this "
                            "error, pass a torch.optim.lr_scheduler.LRScheduler or None.")
        if isinstance(model, nn.Module) and _world_size() > 1 and _sync_kind(model) == "none":
            problems.append(
                f"torch.distributed runs {_world_size()} ranks but the model is a plain {type(model).__name__}: "
                "its gradients would never be synchronised and the ranks' weights would drift apart. To resolve "
                "this error, wrap it in DistributedDataParallel or fully_shard it before building the accumulator."
            )
        ConfigError.raise_if(problems)
        self.model = model
        self.optimizer = optimizer
        self.steps = steps
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.scheduler = scheduler
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._sync = _sync_kind(model)
        # What the optimizer declares of the contract (memtrain.optim.contract), read once. Stepping in backward
        # (ComposedOptimizer(step_in_backward=True)), parameters step inside the last micro-batch's backward, so the
        # window's normalisation, clipping and inf check are handed to it before that backward.
        self._traits = OptimizerTraits.of(optimizer)
        self._steps_in_backward = self._traits.steps_in_backward
        # Counters over the whole run.
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._items_seen = 0
        self._last_grad_norm: float | None = None
        self._results: list[StepResult] = []  # results not read yet: items_seen and last_grad_norm read them
        # fp16 only: the constant sum-reduced losses are multiplied by before backward (see the module docstring).
        self._sum_prescale: float | None = None
        self._reset_window()

    # -- state of the current window ----------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._micro_batches = 0
        self._reduction: Reduction | None = None
        self._stats: torch.Tensor | None = None  # [items, micro-batches, loss sum] on this rank
        self._in_micro_batch = False
        self._is_last = False
        self._backward_done = False
        self._closed = False  # the micro-batch marked is_last=True has run

    @property
    def items_seen(self) -> int:
        """Items stepped on over the run (reading it reads the steps' results: a host sync)."""
        for result in self._results:
            self._items_seen += result.items
            self._last_grad_norm = result.grad_norm
        self._results.clear()
        return self._items_seen

    @property
    def last_grad_norm(self) -> float | None:
        """The last window's gradient norm before clipping (reading it is a host sync)."""
        self.items_seen  # noqa: B018  (folds the pending results in)
        return self._last_grad_norm

    @property
    def micro_batches_in_window(self) -> int:
        """Micro-batches run since the last step()."""
        return self._micro_batches

    def state_dict(self) -> dict[str, Any]:
        """The counters, JSON-serialisable (save the scaler's and scheduler's own state_dict beside it)."""
        return {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
                "items_seen": self.items_seen, "last_grad_norm": self.last_grad_norm,
                "sum_prescale": self._sum_prescale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self._results.clear()
        self._items_seen = int(state["items_seen"])
        self._last_grad_norm = state["last_grad_norm"]
        self._sum_prescale = state.get("sum_prescale")

    # -- one micro-batch ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, *, is_last: bool) -> Iterator[GradientAccumulator]:
        """The context one micro-batch's forward *and* backward run in.

        Gradient sync is off inside it unless ``is_last``: DDP decides at forward time whether the backward
        will all-reduce, so the forward must run inside too.

        Args:
            is_last: True for the last micro-batch of the window (the ``steps``-th, or the last one of the data).
        """
        if not isinstance(is_last, bool):
            raise ConfigError(f"is_last={is_last!r} must be True or False. To resolve this error, pass is_last=True "
                              "for the window's last micro-batch, else False.")
        if self._in_micro_batch:
            raise MemtrainError("acc.micro_batch() entered inside another micro-batch: one micro-batch runs at a "
                                f"time. {_FIX_WINDOW}")
        if self._closed:
            raise MemtrainError(f"a micro-batch started after the window's last one (is_last=True) and before "
                                f"acc.step(): its gradients would join a window that is already synchronised. "
                                f"{_FIX_WINDOW}")
        if not is_last and self._micro_batches + 1 >= self.steps:
            raise MemtrainError(
                f"micro-batch {self._micro_batches + 1} of a {self.steps}-step window is not marked is_last=True: "
                f"the window would hold more micro-batches than steps={self.steps} and its gradients would never be "
                "synchronised. To resolve this error, pass is_last=True on the last micro-batch of each window."
            )
        self._in_micro_batch = True
        self._is_last = is_last
        self._backward_done = False
        try:
            with self._sync_context(is_last):
                yield self
        finally:
            self._in_micro_batch = False
        if not self._backward_done:
            raise MemtrainError(f"a micro-batch ended without acc.backward(loss, ...): its forward ran for nothing "
                                f"and the window's count is wrong. {_FIX_WINDOW}")
        self._closed = is_last

    def _sync_context(self, sync: bool) -> contextlib.AbstractContextManager[object]:
        model = unwrap_model(self.model, ddp=False)  # no_sync() is DDP's own, on its wrapper
        if self._sync == "no_sync" and not sync:
            return model.no_sync()
        if self._sync == "fsdp2":
            return _fsdp2_sync(model, sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, reduction: Reduction, items: int | torch.Tensor | None = None) -> None:
        """Back-propagates one micro-batch's loss into the window's gradients.

        Args:
            loss: a scalar loss.
            reduction: "sum" when ``loss`` is summed over ``items`` (token-count-correct: every item weighs the
                same across the window and the ranks); "mean" when it is already a mean (every micro-batch
                weighs the same, exact only when micro-batches hold equal numbers of items).
            items: how many items (tokens, examples) ``loss`` sums over: an int or an integer tensor (no
                device sync); required with "sum", optional with "mean" (then only counted in ``items_seen``).

        Raises:
            MemtrainError: called outside ``micro_batch``, twice in one micro-batch, or with a reduction other
                than the window's.
            ConfigError: a bad loss, reduction or item count.
        """
        if not self._in_micro_batch:
            raise MemtrainError(f"acc.backward() called outside a micro-batch: the accumulator cannot tell which "
                                f"window it belongs to or whether to synchronise gradients. {_FIX_WINDOW}")
        if self._backward_done:
            raise MemtrainError("acc.backward() called twice in one micro-batch: under DDP the second backward "
                                "would synchronise again. To resolve this error, add the losses and call "
                                "backward once.")
        problems = []
        if reduction not in ("sum", "mean"):
            problems.append(f"reduction={reduction!r} must be 'sum' or 'mean'. To resolve this error, pass "
                            "reduction='sum' with items=, or reduction='mean'.")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            problems.append(f"loss must be a scalar tensor, got {shape}. To resolve this error, reduce it with "
                            ".sum() (and pass items) or .mean().")
        elif not loss.requires_grad:
            problems.append("loss does not require grad: nothing to back-propagate. To resolve this error, compute "
                            "it from the model's output outside torch.no_grad().")
        if items is None and reduction == "sum":
            problems.append("reduction='sum' needs items=<number of items the loss sums over> (e.g. "
                            "(labels != -100).sum() tokens), to normalise the window. To resolve this error, pass "
                            "items=, or reduction='mean' for a loss already averaged.")
        elif items is not None and not _valid_items(items):
            problems.append(f"items={items!r} must be an int >= 0 or a one-element integer tensor. To resolve this "
                            "error, pass e.g. items=(labels != -100).sum().")
        ConfigError.raise_if(problems)
        if self._reduction is not None and reduction != self._reduction:
            raise MemtrainError(
                f"reduction={reduction!r} in a window whose earlier micro-batches used {self._reduction!r}: sum "
                "and mean losses cannot be normalised together. To resolve this error, use one reduction for "
                "every micro-batch (reduction='sum' with items is token-count-correct)."
            )

        scaled = loss
        if self.scaler is not None:
            if reduction == "sum":
                scaled = loss * self._prescale(items)
            scaled = self.scaler.scale(scaled)
        # float64 counts stay exact past 2**24 items; MPS has no float64.
        dtype = torch.float32 if loss.device.type == "mps" else torch.float64
        one = torch.ones((), dtype=dtype, device=loss.device)
        count = (one * 0) if items is None else torch.as_tensor(items, device=loss.device).reshape(()).double()
        stats = torch.stack([count, one, loss.detach().reshape(()).double()])
        window = stats if self._stats is None else self._stats + stats

        if self._steps_in_backward:
            if self._is_last:
                # The window's factor is known before its last backward (on the device: no sync), which steps the
                # parameters. A window of zero items gives an infinite factor: the first gradient to land sets the
                # optimizer's inf flag, so no parameter steps, and step() refuses the window.
                self._reduction = reduction
                divisor = window[0] if reduction == "sum" else float(self._micro_batches + 1)
                factor = self._factor(divisor)
                self.optimizer.prepare_backward(last=True, grad_factor=factor, max_norm=self.max_grad_norm,
                                                scaler=self.scaler)
                self.optimizer.backward(scaled)  # one pass: lagged clipping, the inf flag on the device
            else:
                self.optimizer.prepare_backward(last=False)
                scaled.backward()
        else:
            if self._is_last and self._traits.announces_last_backward:
                # CPUOffloadOptimizer: this backward's landings take the norms the clip at the boundary reads.
                self.optimizer.next_backward_is_last()
            scaled.backward()
        self._stats = window
        self._reduction = reduction
        self._micro_batches += 1
        self._backward_done = True

    def _prescale(self, items: int | torch.Tensor) -> float:
        if self._sum_prescale is None:
            # Same constant on every rank: DDP/FSDP2 average gradients, which is linear only if it is.
            first = torch.as_tensor(items, dtype=torch.float64).reshape(()).cpu()
            if _world_size() > 1:
                first = first.to(_collective_device())
                dist.all_reduce(first, op=dist.ReduceOp.MAX)
            self._sum_prescale = 1.0 / max(float(first), 1.0)
        return self._sum_prescale

    # -- the boundary -------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Ends the window: unscale -> normalise -> clip -> optimizer step -> scaler update -> scheduler step
        -> zero_grad(set_to_none=True), each once.

        Host syncs: one read of the window's numbers (items, loss, norm, inf flag) with clipping, an fp16 scaler,
        host gradients (CPUOffloadOptimizer: its host step needs the factor) or an optimizer that cannot skip a
        step on a device flag; none otherwise (``memtrain.measure.count_host_syncs`` counts them).

        Returns:
            A StepResult. With an fp16 scaler an overflowing window is skipped: parameters, optimizer state and
            scheduler are left as they were, ``skipped`` is True and ``skipped_steps`` grows.

        Raises:
            MemtrainError: no micro-batch ran, the last one was not marked ``is_last=True``, the window holds
                zero items over all ranks, or (without a scaler) the gradient is not finite; the window's
                gradients are dropped, the weights are untouched. NOTE: where nothing is read back (no clipping,
                no scaler, fused AdamW or memtrain's AdamW), the last two cannot be seen on the host: the step is
                skipped on the device instead (fused AdamW leaves weights and moments as they were) and
                ``StepResult.skipped`` says so when read; ``optimizer_steps`` and the scheduler count it as a step.
        """
        if self._in_micro_batch:
            raise MemtrainError(f"acc.step() called inside a micro-batch. {_FIX_WINDOW}")
        if self._micro_batches == 0:
            raise MemtrainError(f"acc.step() with no micro-batch in the window: there is no gradient to step "
                                f"with. {_FIX_WINDOW}")
        if not self._closed:
            raise MemtrainError(
                f"acc.step() after {self._micro_batches} micro-batch(es), none marked is_last=True: under DDP/FSDP2 "
                "the gradients were never synchronised. To resolve this error, pass is_last=True to the window's "
                "last micro-batch (the last one of the data too)."
            )
        world = _world_size()
        stats = self._stats
        if world > 1:
            stats = stats.to(_collective_device())
            dist.all_reduce(stats)
        if self._steps_in_backward:
            return self._finish_stepped_window(stats)
        if self._traits.manages_gradients:
            return self._step_host_gradients(stats)
        return self._step_device_gradients(stats)

    def _step_host_gradients(self, stats: torch.Tensor) -> StepResult:
        """The optimizer streamed the gradients to host memory during backward and unscales them itself (its
        grad_scaler). CPUOffloadOptimizer folds the factor and the clip coefficient into its host step (no pass, no
        read of its own); the window's numbers cross to the host once, as the host step needs the factor."""
        optimizer = self.optimizer
        if self.scaler is not None and not self._traits.found_inf_before_step:
            # ComposedOptimizer with a host part under the fp16 scaler: its own passes and reads (the scaler's inf check).
            items_f, micro_f, loss_sum = stats.tolist()
            divisor = self._check_items(items_f, micro_f)
            optimizer.scale_gradients_(self._factor(divisor))
            grad_norm = float(optimizer.clip_grad_norm_(self.max_grad_norm or math.inf))
            scale_before = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before  # the scale only goes down after an overflow
            return self._end_window(skipped, loss=loss_sum / divisor, grad_norm=grad_norm, items=round(items_f))
        # NOTE: on CUDA this copy is the step's one wait for the device; the read below (host values only) is what
        # count_host_syncs counts for it.
        items_t, micro_t, loss_t = accelerator(stats.device).to_host(stats).unbind()
        divisor_t = items_t if self._reduction == "sum" else micro_t
        optimizer.scale_gradients_(self._factor(divisor_t))  # lazy: folded into the host step
        norm = optimizer.clip_grad_norm_(self.max_grad_norm or math.inf)  # from the norms taken as grads landed
        # ComposedOptimizer with a host part (no scaler here): its device norms joined the host's, read with the rest.
        found = getattr(optimizer, "found_inf_flag", None)
        values = [items_t, micro_t, loss_t, norm.double()] + ([found.double()] if found is not None else [])
        items_f, micro_f, loss_sum, grad_norm, *found_f = torch.stack(values).tolist()
        divisor = self._check_items(items_f, micro_f)
        skipped = self.scaler is not None and bool(found_f) and found_f[0] > 0
        if self.scaler is None and not math.isfinite(grad_norm):
            self._refuse_non_finite(grad_norm)
        optimizer.step()  # skips on its flag, and hands it to the scaler
        if self.scaler is not None:
            self.scaler.update()
        return self._end_window(skipped, loss=loss_sum / divisor, grad_norm=grad_norm, items=round(items_f))

    def _step_device_gradients(self, stats: torch.Tensor) -> StepResult:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        found = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # first: normalising and clipping act on true gradients
            found_per_device = self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
            found = sum(_moved(f, stats.device) for f in found_per_device.values())
        grads = [p.grad for p in params if p.grad is not None]
        divisor = stats[0] if self._reduction == "sum" else stats[1]
        if self._reduction == "mean" and _world_size() == 1:
            divisor = float(self._micro_batches)  # known here: a factor of 1.0 then costs no pass
        factor = self._factor(divisor)
        if grads and (isinstance(factor, torch.Tensor) or factor != 1.0):
            for device, group in _by_device(grads).items():
                f = factor.to(device, torch.float32, non_blocking=True) if isinstance(factor, torch.Tensor) else factor
                torch._foreach_mul_(group, f)
        norm = _grad_norm([p for p in params if p.grad is not None], self.max_grad_norm, stats.device)
        items, micro_f, loss_sum = stats.unbind()
        loss = loss_sum / (items if self._reduction == "sum" else micro_f)
        if self.scaler is None and self.max_grad_norm is None and self._traits.takes_skip_flag:
            # Nothing to read back: a non-finite gradient or an empty window skips the step on the device.
            flag = (~norm.isfinite() | ((items <= 0) & (self._reduction == "sum"))).float()
            _step_with_flag(self.optimizer, flag, self._traits)
            return self._end_window(False, on_device=torch.stack([loss, norm, flag.double(), items]))
        # The one read: the window's numbers together.
        values = [items, micro_f, loss_sum, norm] + ([found.double()] if found is not None else [])
        read = torch.stack(values).tolist()
        items_f, micro_host, loss_sum_f, grad_norm = read[:4]
        divisor_f = self._check_items(items_f, micro_host)
        skipped = False
        if self.scaler is not None:
            skipped = read[4] > 0
            if not skipped:
                _step_with_flag(self.optimizer, None, self._traits)
            self.scaler.update()  # reads the inf check unscale_ recorded, on the device
        elif not math.isfinite(grad_norm):
            self._refuse_non_finite(grad_norm)
        else:
            self.optimizer.step()
        return self._end_window(skipped, loss=loss_sum_f / divisor_f, grad_norm=grad_norm, items=round(items_f))

    def _check_items(self, items_f: float, micro_f: float) -> float:
        """The window's divisor (items or micro-batches); refuses a sum-reduced window of zero items."""
        items = round(items_f)
        if self._reduction == "sum" and items <= 0:
            message = (
                f"the window holds {items} items over {_world_size()} rank(s) ({self._micro_batches} micro-batch(es) "
                "here): a sum-reduced loss over nothing cannot be normalised. To resolve this error, skip "
                "micro-batches whose labels are all -100 before the window, or count items as (labels != -100).sum()."
            )
            self.discard_window()
            raise MemtrainError(message)
        return items_f if self._reduction == "sum" else micro_f

    def _refuse_non_finite(self, grad_norm: float) -> None:
        self.skipped_steps += 1
        self.discard_window()
        raise MemtrainError(
            f"the gradient norm is {grad_norm} at optimizer step {self.optimizer_steps + 1} and no fp16 scaler "
            "owns overflows: stepping would write nan into the weights, so the step was not taken and the "
            "window's gradients were dropped. To resolve this error, lower the learning rate, set "
            f"{arg('max_grad_norm')}, or check the data of this window for inf/nan."
        )

    def _end_window(self, skipped: bool, *, loss: float | None = None, grad_norm: float | None = None,
                    items: int | None = None, on_device: torch.Tensor | None = None) -> StepResult:
        if skipped:
            self.skipped_steps += 1  # the scheduler stays where it was: no update happened
        else:
            self.optimizer_steps += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # None, not zeros: frees the gradients' memory
        micro_batches = self._micro_batches
        self._reset_window()
        result = StepResult(step=self.optimizer_steps, micro_batches=micro_batches, loss=loss, grad_norm=grad_norm,
                            skipped=skipped, items=items, on_device=on_device)
        self._results.append(result)
        return result

    def _factor(self, divisor: float | torch.Tensor) -> float | torch.Tensor:
        """What every gradient is multiplied by at the boundary: world size / items (sum) or / micro-batches;
        a device tensor when the divisor is one (no host sync)."""
        # DDP and FSDP2 average gradients over the ranks; multiply by the world size to get the sum back.
        factor = (_world_size() if self._sync != "none" else 1) / divisor
        if self._reduction == "sum" and self.scaler is not None:
            factor = factor / self._sum_prescale
        return factor

    def _finish_stepped_window(self, stats: torch.Tensor) -> StepResult:
        """The boundary of a step-in-backward window: the parameters stepped in the last backward (normalised,
        clipped by the last window's norm, unscaled), and the backward's end stepped the leftovers and the host
        part; ``optimizer.step()`` reports the norm and the inf flag, then the scaler and scheduler follow. One read
        with clipping or a scaler, none otherwise."""
        self.optimizer.step()  # GradScaler.step is not used: the inf flag lives in the optimizer (window_found_inf)
        norm = self.optimizer.last_grad_norm
        found = self.optimizer.window_found_inf
        if found is None:
            found = torch.zeros((), device=norm.device)
        items, micro_f, loss_sum = stats.unbind()
        device = norm.device
        loss = loss_sum / (items if self._reduction == "sum" else micro_f)
        if self.scaler is not None:
            self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"] = {found.device: found}
            self.scaler.update()  # backs off on the device when an inf was seen
        if self.scaler is None and self.max_grad_norm is None:
            values = torch.stack([loss.to(device), norm.double(), found.double(), items.to(device)])
            return self._end_window(False, on_device=values)
        items_f, micro_host, loss_sum_f, grad_norm, found_f = torch.stack(
            [items.to(device), micro_f.to(device), loss_sum.to(device), norm.double(), found.double()]).tolist()
        divisor = self._check_items(items_f, micro_host)
        skipped = found_f > 0 and self.scaler is not None
        if not skipped and not math.isfinite(grad_norm):
            self.skipped_steps += 1
            guarded = self._traits.guards_non_finite
            self.discard_window()
            raise MemtrainError(
                f"the gradient norm is {grad_norm} at optimizer step {self.optimizer_steps + 1} and no fp16 scaler "
                "owns overflows: with step-in-backward the parameters whose gradients came before the first "
                "non-finite one stepped during backward and no later one did"
                + (" (the weights hold no nan); " if guarded else
                   "; with bf16 or int8 moments (or another optimizer class) the parameter with the non-finite "
                   "gradient may hold nan: resume "
                   "from the last checkpoint; ")
                + "the window's other gradients were dropped. To resolve this error, lower the learning rate, "
                "or check the data of this window for inf/nan.")
        return self._end_window(skipped, loss=loss_sum_f / divisor, grad_norm=grad_norm, items=round(items_f))

    def discard_window(self) -> None:
        """Drops the current window's gradients and counts without stepping (e.g. after an out-of-memory error
        in one of its micro-batches); the next micro-batch starts a new window."""
        if self._in_micro_batch:
            raise MemtrainError(f"acc.discard_window() called inside a micro-batch. {_FIX_WINDOW}")
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()


@contextlib.contextmanager
def _fsdp2_sync(model: Any, sync: bool) -> Iterator[None]:
    # FSDP2 modules have no no_sync(): without this flag every micro-batch's backward reduce-scatters.
    # NOTE: with sync off FSDP2 accumulates *unsharded* gradients until the last micro-batch: one full copy of
    # each sharded group's gradients per rank, traded for a reduce-scatter per micro-batch.
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _valid_items(items: object) -> bool:
    if isinstance(items, torch.Tensor):
        return items.numel() == 1 and not items.is_floating_point() and not items.is_complex()
    return isinstance(items, int) and not isinstance(items, bool) and items >= 0


def _collective_device() -> torch.device:
    # gloo reduces CPU tensors, NCCL reduces CUDA tensors.
    if "nccl" in dist.get_backend():
        return accelerator().device  # this rank's current device
    return torch.device("cpu")


def _grad_norm(params: list[torch.Tensor], max_norm: float | None, device: torch.device) -> torch.Tensor:
    """The global norm of the gradients (a tensor on ``device``; not read), clipping them to ``max_norm`` on the
    device when given (torch's coefficient, a tensor: no host sync)."""
    if not params:
        return torch.zeros((), dtype=torch.float64, device=device)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor norm over the shards
        norm = norm.full_tensor()
    return _moved(norm, device, torch.float64)


def _moved(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (cast to ``dtype``) on ``device``, across devices through the device seam: a copy to the host is read
    only after it completed (a non-blocking ``.to("cpu")`` read by the host before the device finished is not)."""
    t = t.to(dtype) if dtype is not None else t
    if t.device == device:
        return t
    if device.type == "cpu":
        return accelerator(t.device).to_host(t)
    return accelerator(device).to_device(t)


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _step_with_flag(optimizer: torch.optim.Optimizer, flag: torch.Tensor | None, traits: OptimizerTraits) -> None:
    """``optimizer.step()``, skipped on the device where ``flag`` is 1 (weights, moments and step count left as
    they were), with the gradients already unscaled."""
    step_with_inf_flag(optimizer, flag if flag is not None and traits.takes_skip_flag else None)
