"""CPUOffloadOptimizer: optimizer state and fp32 master weights on the CPU, the step overlapped with GPU work.

Trade-off: the device keeps only the weights (and, briefly, each gradient), saving 12 bytes per parameter for
AdamW with fp32 weights (8 of state + 4 of gradient), at the cost of a CPU optimizer step and two PCIe transfers
per step, which run on a worker thread and a side stream so that they hide behind GPU work.

How a step flows:

- backward: a post-accumulate-grad hook copies each gradient device -> host on a side stream as soon as autograd
  has produced it and frees the device gradient. A second micro-batch's gradient is added into the host buffer,
  so gradient accumulation needs no change to the loop. The host side of the landings (waiting for the copies,
  adding, casting) is handed to the worker thread once per bucket: one event and one task per bucket.
- ``scale_gradients_(factor)`` and ``clip_grad_norm_(max_norm)`` (optional) make no pass over the host gradients:
  the factor, the fp16 inverse scale and the clip coefficient become one multiplier that the CPU step applies to
  each bucket just before stepping it, on the worker; the global norm (as ``torch.nn.utils.clip_grad_norm_``
  computes it, within float rounding after ``scale_gradients_``) comes from the per-tensor norms the worker took
  as the gradients landed during the window's last backward, which ``next_backward_is_last()`` announces
  (``GradientAccumulator`` calls it on the micro-batch marked ``is_last``); loops of one backward per step get
  them without it, after their first clip.
- ``step()``: after ``clip_grad_norm_`` or with a ``GradScaler`` attached, a non-finite norm (an overflow) skips
  the step on the worker,
  weights and state untouched; otherwise the wrapped optimizer steps bucket by bucket on the worker thread, and
  each bucket's weights go back host -> device (in the device parameter's dtype) on the host->device side stream
  while the next bucket steps; the gradients came down on the other side stream.
- ``step_in_next_backward()`` (no clipping, no fp16 scaler): the next backward steps each bucket as soon as its
  last gradient lands, so the CPU step overlaps the rest of backward.
- ``delayed_update=True``: ``step()`` returns at once and the CPU step runs during the next forward and backward
  (see the class docstring for the exact semantics).

On a CPU-only machine the "device" is the CPU: the same code runs with no streams and no pinned memory.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from memtrain.errors import ConfigError, MemtrainError
from memtrain.measure import available_host_bytes
from memtrain.report import format_bytes

# Group keys that choose an implementation rather than the maths: they stay with each side's own optimizer when a
# state_dict moves between this class and a plain one (a device AdamW's fused=True must not reach the host one).
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
# Bytes of optimizer state per parameter assumed for the host-RAM check (exact for Adam/AdamW without amsgrad).
STATE_BYTES_PER_PARAM = {torch.optim.Adam: 8, torch.optim.AdamW: 8, torch.optim.SGD: 4}


@dataclass(eq=False)
class _Slot:
    """One parameter: its device tensor and its host views (fp32 master, gradient buffers, cast buffer)."""

    key: int | str  # its key in state_dict(): the parameter's name when known, else its index
    group: int  # index in param_groups
    device: torch.Tensor
    master: torch.Tensor  # fp32 host weights; also the parameter the wrapped optimizer steps
    grads: tuple[torch.Tensor, ...]  # one host gradient buffer, two with delayed_update
    cast: torch.Tensor | None  # pinned host copy in the device dtype, when that is not fp32 (halves PCIe bytes)
    # Pinned host buffer the device-dtype gradient lands in before the worker casts (or adds) it into ``grads``:
    # owned and counted in the host-RAM check, not torch's pinned cache (rounded up to powers of two, kept).
    stage: torch.Tensor | None = None
    reader: Future[None] | None = None  # the worker task still reading ``stage``
    has_grad: bool = False
    zeroed: bool = False  # the host buffer holds zeros (zero_grad(set_to_none=False)): copy, don't add
    # 2-norm of the host gradient, taken by the worker as it lands; written only by the worker (in task order), or
    # by the loop's thread once no task is pending.
    norm: torch.Tensor | None = None
    landings: int = 0  # backwards that landed a gradient in this window
    bucket: int = -1


@dataclass(eq=False)
class _Landing:
    """One gradient copied device -> host, whose host side (add or cast, norm) the worker finishes."""

    slot: _Slot
    dst: torch.Tensor
    staged: torch.Tensor | None  # the copied gradient, when it must be added or cast into dst
    copy: bool  # staged replaces dst (first landing of the window) instead of adding to it
    want_norm: bool


@dataclass(eq=False)
class _Bucket:
    """Parameters stepped together: one wrapped optimizer each, so a bucket's weights can go back early."""

    slots: list[_Slot]
    inner: torch.optim.Optimizer
    group_of: list[int]  # inner group i mirrors param_groups[group_of[i]]


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """Runs ``optimizer_class`` on the CPU on fp32 master weights; the device holds only the model's weights.

    Trade-off: saves the optimizer state and the gradients on the device (12 bytes per fp32 parameter with AdamW)
    for a CPU step (fused AdamW: about 4 G params/s on 16 threads) and one device->host and one host->device copy
    of the parameters per step, overlapped with backward and with each other.

    Args:
        params: parameters, ``(name, parameter)`` pairs (e.g. ``model.named_parameters()``: state_dict() is then
            keyed by name) or parameter groups (dicts), all on one device and all requiring grad.
        optimizer_class: a ``torch.optim.Optimizer`` subclass, run on the CPU. Adam and AdamW default to
            ``fused=True`` there (same maths, rounding may differ from the for-loop kernel by about 1 ulp) unless
            ``fused`` or ``foreach`` is given.
        offload_gradients: True (default) copies each gradient to the host during backward and frees it on the
            device; later micro-batches add into the host buffer. False keeps gradients on the device (they
            accumulate there, 4 bytes per parameter) and copies them at ``clip_grad_norm_``/``step``.
        delayed_update: True returns from ``step()`` at once and runs the CPU step during the next forward and
            backward (DeepSpeed's "delayed parameter update"). The weights of step t reach the device at the
            next ``step()`` call (or ``synchronize()``), so the gradient of step t+1 is computed on the weights
            before update t: each update uses a gradient one step stale. Each ``step()`` consumes its gradients
            (the next backward writes a second host buffer: 4 more bytes per parameter of host RAM). Call
            ``synchronize()`` before evaluating or saving the model.
        device_dtype: e.g. ``torch.bfloat16``: the fp32 masters are taken from the parameters as given, then the
            device parameters are cast to this dtype (2 bytes per parameter off the device, and the master keeps
            the weights' fp32 digits; casting the model first would start the master from rounded weights).
        grad_scaler: the fp16 ``torch.amp.GradScaler`` in use, if any: ``step()`` then unscales the host
            gradients and checks them for inf/NaN itself (``scaler.unscale_(optimizer)`` cannot see gradients on
            the host: call ``optimizer.clip_grad_norm_`` instead; ``scaler.step``/``scaler.update`` work as usual).
        **optimizer_kwargs: hyper-parameters of ``optimizer_class`` (lr, betas, weight_decay, ...).

    Raises:
        ConfigError: no parameters, several devices, parameters that do not require grad, a class that is not a
            torch optimizer, or hyper-parameters it does not accept.
        MemtrainError: not enough free host RAM for the buffers (checked before allocating anything); a sparse
            gradient (raised during backward).

    Example:
        >>> model = torch.nn.Linear(8, 4)
        >>> opt = CPUOffloadOptimizer(model.named_parameters(), lr=1e-3, weight_decay=0.1)
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> norm = opt.clip_grad_norm_(1.0)  # instead of torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> opt.step()
        >>> opt.zero_grad(set_to_none=True)
    """

    # Parameters per bucket: large enough that the fused kernel runs at full speed, small enough that the first
    # bucket's weights start crossing PCIe while the rest still step.
    bucket_numel = 1 << 25

    # NOTE: GradScaler.step() hands over grad_scale/found_inf attributes to optimizers that say so; we take the
    # scale from the attached grad_scaler instead and write our own inf check back for scaler.update().
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        offload_gradients: bool = True,
        delayed_update: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        device_dtype: torch.dtype | None = None,
        **optimizer_kwargs: Any,
    ):
        groups, names = _parse_params(params, optimizer_class)
        flat = [p for g in groups for p in g["params"]]
        self.device = flat[0].device
        cuda = self.device.type == "cuda"
        pin = torch.cuda.is_available()  # pinned memory makes D2H/H2D copies asynchronous; CPU-only: nothing to pin
        if offload_gradients and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The tensor hook runs before DDP's reducer: the host would get this rank's unsynchronised gradient.
            raise ConfigError(
                f"CPUOffloadOptimizer(offload_gradients=True) with {dist.get_world_size()} ranks: gradients would "
                "leave the device before DDP averages them, and the ranks' weights would drift apart. To resolve "
                "this error, pass offload_gradients=False (they are copied at the step, after synchronisation)."
            )
        self.offload_gradients = offload_gradients
        self.delayed_update = delayed_update
        self.grad_scaler = grad_scaler
        if (optimizer_class in (torch.optim.Adam, torch.optim.AdamW)
                and "fused" not in optimizer_kwargs and "foreach" not in optimizer_kwargs):
            optimizer_kwargs["fused"] = True  # the fused CPU kernel: several times the for-loop's throughput
        _check_host_ram(flat, optimizer_class, n_grad_buffers=2 if delayed_update else 1, pin=pin,
                        device_dtype=device_dtype)
        # Probe the class and its arguments on one-element stand-ins, before allocating gigabytes.
        try:
            template = optimizer_class(
                [{**{k: v for k, v in g.items() if k != "params"}, "params": [torch.zeros(1, requires_grad=True)]}
                 for g in groups],
                **optimizer_kwargs,
            )
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{optimizer_class.__name__}({optimizer_kwargs}) rejected its arguments: {e}. To resolve "
                              f"this error, pass only hyper-parameters {optimizer_class.__name__} accepts.") from None

        # A few large flat buffers, parameters laid out in reverse registration order (roughly the order backward
        # produces their gradients) so that a bucket is a contiguous range. Only what crosses PCIe is pinned.
        order = list(reversed(range(len(flat))))
        total = sum(_aligned(p.numel()) for p in flat)
        master_flat = _host_buffer(total, torch.float32, pin)
        # Never read before written: a gradient's first landing copies, later ones add.
        grad_flats = [_host_buffer(total, torch.float32, pin) for _ in range(1 + delayed_update)]
        def target(p: torch.Tensor) -> torch.dtype:  # the device parameter's dtype once set up
            return device_dtype if device_dtype is not None and p.is_floating_point() else p.dtype

        cast_numel: dict[torch.dtype, int] = {}
        for p in flat:
            if target(p) != torch.float32:
                cast_numel[target(p)] = cast_numel.get(target(p), 0) + _aligned(p.numel())
        cast_flats = {dt: _host_buffer(n, dt, pin) for dt, n in cast_numel.items()}
        stage_flats = {dt: _host_buffer(n, dt, pin) for dt, n in cast_numel.items()}  # same layout as the casts
        group_index = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        slots: dict[int, _Slot] = {}
        offset, cast_offset = 0, dict.fromkeys(cast_flats, 0)
        for i in order:
            p, n = flat[i], flat[i].numel()
            cast = stage = None
            if target(p) in cast_flats:
                start = cast_offset[target(p)]
                cast = cast_flats[target(p)][start:start + n].view(p.shape)
                stage = stage_flats[target(p)][start:start + n].view(p.shape)
                cast_offset[target(p)] += _aligned(n)
            slot = _Slot(
                key=names[i] if names is not None else i,
                group=group_index[id(p)],
                device=p,
                master=master_flat[offset:offset + n].view(p.shape),
                grads=tuple(g[offset:offset + n].view(p.shape) for g in grad_flats),
                cast=cast,
                stage=stage,
            )
            with torch.no_grad():
                slot.master.copy_(p.detach())
                if target(p) != p.dtype:
                    p.data = p.data.to(target(p))  # after the master took the full-precision digits
            slots[i] = slot
            offset += _aligned(n)
        self._slots = [slots[i] for i in range(len(flat))]  # in param_groups order, as torch iterates them

        # The outer param_groups (what LR schedulers and users see) hold the device parameters; the wrapped
        # optimizers hold the host masters. step() copies the former's hyper-parameters into the latter before
        # every CPU step, so that an LR change takes effect.
        defaults = {k: v for k, v in template.defaults.items() if k not in IMPLEMENTATION_KEYS}
        outer = [{**{k: v for k, v in tg.items() if k not in ("params", *IMPLEMENTATION_KEYS)}, "params": g["params"]}
                 for tg, g in zip(template.param_groups, groups, strict=True)]
        self._adding = True
        super().__init__(outer, defaults)
        self._adding = False
        if names is not None:
            for g, ids in zip(self.param_groups, _group_indices(groups), strict=True):
                g["param_names"] = [names[i] for i in ids]
        self._buckets = self._make_buckets([slots[i] for i in order], optimizer_class, optimizer_kwargs)
        self._link_state()

        # One side stream per direction of the link: the copies back (host -> device) of a delayed update then run
        # beside the next backward's gradient copies (device -> host) instead of queueing behind them, and the two
        # PCIe directions overlap.
        self._streams: dict[str, Any] = {d: torch.cuda.Stream(self.device) if cuda else None for d in _DIRECTIONS}
        # Bytes that crossed (or, on a CPU-only run, would cross) the host link, per direction, over the run.
        self.link_bytes = dict.fromkeys(_DIRECTIONS, 0)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtrain-cpu-optim")
        self._landings: list[Future[None]] = []
        # Per bucket: this backward's landings not yet handed to the worker, and the slots not landed yet. A
        # bucket's landings go to the worker in one task once all its slots landed (or at clip/step time).
        self._pending: list[list[_Landing]] = [[] for _ in self._buckets]
        self._unlanded: list[set[int]] = [{id(s) for s in b.slots} for b in self._buckets]
        self._update: list[Future[None]] | None = None  # the CPU step in flight (delayed_update)
        self._h2d_done: torch.cuda.Event | None = None
        self._buffer = 0  # which host gradient buffer the next backward writes
        self._gathered = False  # this step's gradients are on the host, attached, unscaled
        self._found_inf: torch.Tensor | None = None  # an inf check made by GradScaler on the device (unscale_)
        # This step's lazy gradient multiplier (scale_gradients_ factors, fp16 inverse scale), and the window's
        # (norm, multiplier with the clip coefficient, inf flag) once clip_grad_norm_ or step made them.
        self._grad_factor: float | torch.Tensor = 1.0
        self._inv_scale: torch.Tensor | None = None
        self._scalars: tuple[torch.Tensor, float | torch.Tensor, torch.Tensor] | None = None
        # next_backward_is_last(): the worker takes each gradient's norm as it lands in the next backward.
        self._norms_in_backward = False
        # Set by a clip_grad_norm_ after a window of one backward: the worker then takes the norm of each gradient
        # landing first in its window (a loop with one backward per step needs no call to get them).
        self._norms_on_first_landing = False
        # step_in_next_backward(): the buckets whose gradients have not all landed yet, and the steps started.
        self._waiting: list[set[int]] | None = None
        self._early: dict[int, Future[None]] = {}
        self._hooks = [s.device.register_post_accumulate_grad_hook(self._make_hook(s)) for s in self._slots]
        for slot in self._slots:
            _claim(slot.device, self)
        # An optimizer that is dropped without close() must not keep taking gradients: the hooks hold it weakly,
        # and this removes them (and stops the worker) once it is collected.
        self._finalizer = weakref.finalize(self, _release, list(self._hooks), self._worker,
                                           [s.device for s in self._slots])

    # -- set-up -------------------------------------------------------------------------------------------------
    def _make_buckets(self, slots: list[_Slot], optimizer_class: type[torch.optim.Optimizer],
                      optimizer_kwargs: dict[str, Any]) -> list[_Bucket]:
        runs = [[slots[i] for i in run] for run in bucket_runs([s.master.numel() for s in slots], self.bucket_numel)]
        buckets = []
        for index, run in enumerate(runs):
            for slot in run:
                slot.bucket = index
            group_of = sorted({s.group for s in run})
            inner_groups = [{**self._hyperparameters(gi), "params": [s.master for s in run if s.group == gi]}
                            for gi in group_of]
            buckets.append(_Bucket(run, optimizer_class(inner_groups, **optimizer_kwargs), group_of))
        return buckets

    def _hyperparameters(self, gi: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[gi].items() if k not in ("params", "param_names")}

    def _link_state(self) -> None:
        # optimizer.state[device_param] is the host state itself (the same dict objects), so tools that count or
        # inspect optimizer.state see it; the wrapped optimizers fill these dicts in place at their first step.
        self.state.clear()
        for bucket in self._buckets:
            for slot in bucket.slots:
                self.state[slot.device] = bucket.inner.state[slot.master]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_adding", False):
            raise MemtrainError("CPUOffloadOptimizer.add_param_group: the host buffers are sized once, at "
                                "construction. To resolve this error, pass every parameter group to the constructor.")
        super().add_param_group(param_group)

    # -- backward: gradients stream to the host ----------------------------------------------------------------
    def _side_stream(self, direction: str) -> Any:
        """The context a copy over the link is issued in: ``direction``'s own side stream (none on the CPU)."""
        stream = self._streams[direction]
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _make_hook(self, slot: _Slot) -> Callable[[torch.Tensor], None]:
        owner = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self = owner()
            if self is None:  # the optimizer is gone: leave the gradient where backward put it
                return
            if param.grad is not None and param.grad.layout != torch.strided:
                raise MemtrainError(
                    f"parameter {slot.key!r} received a sparse gradient ({param.grad.layout}); CPUOffloadOptimizer "
                    "keeps dense host buffers. To resolve this error, build the module with sparse=False (e.g. "
                    "nn.Embedding(..., sparse=False)) or keep that parameter on a separate device optimizer.")
            if self.offload_gradients:
                self._land(slot, free=True)
        return hook

    def _land(self, slot: _Slot, *, free: bool) -> None:
        """Copies ``slot``'s device gradient into its host buffer (added when one is already there)."""
        grad = slot.device.grad
        if grad is None:
            return
        dst = slot.grads[self._buffer]
        # Without offload_gradients the device gradient already holds the micro-batches' sum: copy, never add.
        copy = not slot.has_grad or slot.zeroed or not free
        if id(slot) not in self._unlanded[slot.bucket]:
            # Landed again before its bucket completed (a new backward, or a parameter that got no gradient in
            # the last one): hand over what is pending first, so that a bucket never holds two backwards' copies.
            self._flush_bucket(slot.bucket)
        d2h = self._streams["device_to_host"]
        if d2h is not None:
            # The gradient was produced on the stream current here (autograd's for this leaf): copy it only once
            # it is complete. Read before entering the side stream's context, which changes the current stream.
            d2h.wait_stream(torch.cuda.current_stream(self.device))
        self.link_bytes["device_to_host"] += grad.numel() * grad.element_size()
        with self._side_stream("device_to_host"):
            staged = None
            if copy and grad.dtype == torch.float32:
                dst.copy_(grad, non_blocking=True)  # straight into the pinned buffer
            elif d2h is None and grad.dtype == torch.float32:
                dst.add_(grad)  # the "device" is the CPU: adding now costs one pass, staging a copy two
            elif slot.stage is not None and grad.dtype == slot.stage.dtype:
                # Another dtype (bf16 device weights): into the owned pinned stage, the worker casts or adds it.
                if slot.reader is not None:
                    slot.reader.result()  # the last landing's task must have read the stage (long done, in practice)
                slot.stage.copy_(grad, non_blocking=True)
                staged = slot.stage
            else:
                # NOTE: an fp32 sum on CUDA (a later micro-batch of the window) is staged through torch's pinned
                # cache: an owned buffer would cost 4 more bytes per parameter of host RAM for every run.
                staged = grad.to("cpu", non_blocking=True, copy=True)
            if d2h is not None:
                grad.record_stream(d2h)  # the allocator must not reuse it before the copy is done
        want_norm = self._norms_in_backward or (self._norms_on_first_landing and copy)
        slot.has_grad, slot.zeroed = True, False
        slot.landings += 1
        if free:
            slot.device.grad = None
        self._pending[slot.bucket].append(_Landing(slot, dst, staged, copy, want_norm))
        unlanded = self._unlanded[slot.bucket]
        unlanded.discard(id(slot))
        if not unlanded:
            self._flush_bucket(slot.bucket)
        if self._waiting is not None:
            self._maybe_step_bucket(slot)

    def _flush_bucket(self, index: int) -> None:
        """Hands the bucket's pending landings to the worker: one event (the side stream's copies so far) and one
        task that waits for it, adds or casts each staged gradient and takes the norms asked for."""
        landings, self._pending[index] = self._pending[index], []
        self._unlanded[index] = {id(s) for s in self._buckets[index].slots}
        if not landings:
            return
        event = None
        if self._streams["device_to_host"] is not None:
            event = torch.cuda.Event()
            event.record(self._streams["device_to_host"])  # after every copy of this bucket: in stream order
        # Always a task, even with nothing to add: only the worker writes the slots' norms (in task order).
        task = self._worker.submit(_finish_landings, landings, event)
        self._landings.append(task)
        for landing in landings:
            if landing.staged is not None and landing.staged is landing.slot.stage:
                landing.slot.reader = task

    def _flush_landings(self) -> None:
        for index in range(len(self._buckets)):
            self._flush_bucket(index)

    def next_backward_is_last(self) -> None:
        """Says that the next backward is the last of the accumulation window (the one before
        ``clip_grad_norm_``/``step()``): the worker takes each gradient's norm as it lands in it, so that the clip
        reads no gradient again. ``GradientAccumulator`` calls it on the micro-batch marked ``is_last=True``.

        Without it, a loop of one backward per step gets the same after its first clip; a window of several
        backwards then takes the norms at ``clip_grad_norm_`` (one more pass over the host gradients).
        """
        self._norms_in_backward = True

    def _maybe_step_bucket(self, slot: _Slot) -> None:
        if slot.bucket in self._early:
            raise MemtrainError(
                f"the gradient of {slot.key!r} landed twice in one backward after step_in_next_backward() (reentrant "
                "checkpointing runs one backward per block): its bucket was already stepped. To resolve this error, "
                "use non-reentrant checkpointing (memtrain.apply_checkpointing) or do not arm the backward.")
        waiting = self._waiting[slot.bucket]
        waiting.discard(id(slot))
        if not waiting:
            # The worker queue is FIFO: this runs after the bucket's landings (handed over first), on complete
            # gradients.
            self._flush_bucket(slot.bucket)
            bucket = self._buckets[slot.bucket]
            for s in bucket.slots:
                s.master.grad = s.grads[self._buffer]
            h2d = self._streams["host_to_device"]
            if h2d is not None:
                # The copy back of these weights must not overtake the backward kernels already queued that still
                # read them (this layer's input gradient, issued before its weight's gradient landed): the
                # host-to-device stream waits for everything queued on the compute stream so far.
                h2d.wait_stream(torch.cuda.current_stream(self.device))
            self._early[slot.bucket] = self._worker.submit(self._step_bucket, bucket, self._h2d_done, True)

    def step_in_next_backward(self) -> None:
        """Arms the next backward to run the CPU step of each bucket as soon as its last gradient lands.

        The CPU step then overlaps the rest of backward instead of following it; ``step()`` must follow the
        backward, as usual: it waits for those steps and runs any bucket left (one holding a parameter that got no
        gradient). Call it before the backward of the last micro-batch of a window only, and only without
        ``clip_grad_norm_`` and without an fp16 scaler: both need every gradient before any update (with them,
        ``delayed_update=True`` hides the CPU step instead).

        Raises:
            MemtrainError: with a grad_scaler, delayed_update or offload_gradients=False.
        """
        problems = []
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            problems.append("an fp16 grad_scaler (the inf check needs every gradient before any update)")
        if self.delayed_update:
            problems.append("delayed_update=True (its CPU step already runs during the next forward and backward)")
        if not self.offload_gradients:
            problems.append("offload_gradients=False (gradients reach the host only at step())")
        if problems:
            raise MemtrainError(f"step_in_next_backward() cannot run with {' and '.join(problems)}. To resolve "
                                "this error, drop the call: step() runs the CPU step after backward.")
        self._sync_hyperparameters()
        self._waiting = [{id(s) for s in b.slots} for b in self._buckets]

    # -- the step -----------------------------------------------------------------------------------------------
    def _gather(self) -> None:
        """Makes this step's gradients ready on the host: landed, attached to the masters, unscaled (fp16)."""
        if self._gathered:
            return
        self._finish_update()  # delayed_update: the previous CPU step reads the masters' .grad until it is done
        if not self.offload_gradients:
            for slot in self._slots:
                self._land(slot, free=False)
        self._flush_landings()  # buckets holding a parameter that got no gradient
        for future in self._landings:
            future.result()  # re-raises a worker error here
        self._landings.clear()
        self._norms_in_backward = False
        for slot in self._slots:
            slot.master.grad = slot.grads[self._buffer] if slot.has_grad else None
        self._found_inf = None
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            state = self.grad_scaler._per_optimizer_states[id(self)]
            if state["stage"].name == "UNSCALED":
                self._check_unscaled_on_device()
                # The scaler unscaled the device gradients before we copied them, and checked them for inf.
                self._found_inf = sum(t.cpu() for t in state["found_inf_per_device"].values()) + torch.zeros(())
                self._gathered = True
                return
            # No pass here: the inverse scale (GradScaler.unscale_'s arithmetic: double, then fp32) joins the
            # multiplier the host step divides by, and the inf check is the norm's (see _window_scalars).
            self._inv_scale = self.grad_scaler._scale.double().reciprocal().float().to("cpu", copy=True)
        self._gathered = True

    def _check_unscaled_on_device(self) -> None:
        if self.offload_gradients:
            raise MemtrainError(
                "scaler.unscale_(optimizer) was called, but CPUOffloadOptimizer's gradients live on the host where "
                "the scaler cannot see them: they would stay scaled. To resolve this error, remove "
                "scaler.unscale_(optimizer) and call optimizer.clip_grad_norm_(max_norm), which unscales first (or "
                "build the optimizer with offload_gradients=False to keep gradients on the device).")

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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Steps the wrapped optimizer on the host and copies the weights back (see the class docstring).

        Skips the update (weights and state untouched) when the attached grad_scaler found inf/NaN.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # GradScaler.step() sets grad_scale (gradients still scaled) or only found_inf (after scaler.unscale_).
        scaler_found_inf = None
        if self.grad_scaler is None and getattr(self, "found_inf", None) is not None:
            if getattr(self, "grad_scale", None) is not None:
                raise MemtrainError(
                    "scaler.step(optimizer) was called, but CPUOffloadOptimizer was built without the scaler, so "
                    "it cannot unscale its host gradients nor report an overflow to scaler.update(). To resolve "
                    "this error, pass grad_scaler=scaler to CPUOffloadOptimizer(...).")
            self._check_unscaled_on_device()
            scaler_found_inf = torch.as_tensor(self.found_inf).cpu()
        self._gather()
        if scaler_found_inf is not None:
            self._found_inf = scaler_found_inf
        if self._found_inf is not None and self.grad_scaler is not None:
            # NOTE: GradScaler has no public way to receive an inf check made elsewhere: scaler.update() reads it
            # from here to back off the scale. Written in step() because scaler.step() resets it before calling us.
            self.grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {
                self._found_inf.device: self._found_inf}
        # The window's multiplier (normalisation, fp16 inverse scale, clip coefficient) and inf flag: the host step
        # applies them as it reads each gradient, and skips on the flag on the worker (a host value: no device
        # sync, and no Python read of it on this thread).
        if self._scalars is None and self._inv_scale is not None:
            self._scalars = self._window_scalars()  # an fp16 step needs the inf check: the norm's
        if self._scalars is not None:
            _, multiplier, found = self._scalars
        else:
            multiplier, found = self._multiplier(), None
        if self._found_inf is not None:
            found = self._found_inf if found is None else torch.maximum(found, self._found_inf.to(found.device))
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            # NOTE: GradScaler has no public way to receive an inf check made elsewhere: scaler.update() reads it
            # from here to back off the scale. Written in step() because scaler.step() resets it before calling us.
            found = found if found is not None else torch.zeros(())
            self.grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {found.device: found}
        early, self._early, self._waiting = self._early, {}, None
        self._sync_hyperparameters()
        if self._streams["host_to_device"] is not None:
            # The copies back overwrite weights that this step's backward read on the compute stream.
            self._streams["host_to_device"].wait_stream(torch.cuda.current_stream(self.device))
        h2d_done = self._h2d_done
        futures = list(early.values())  # stepped during backward (step_in_next_backward)
        futures += [self._worker.submit(self._step_bucket, b, h2d_done, not self.delayed_update, multiplier, found)
                    for i, b in enumerate(self._buckets) if i not in early]
        if self.delayed_update:
            self._update = futures
            self._buffer = 1 - self._buffer  # the next backward writes the other host buffer
            for slot in self._slots:
                slot.has_grad = slot.zeroed = False
                slot.landings = 0
        else:
            for future in futures:
                future.result()
            self._after_copies()
        self._gathered = False
        self._grad_factor, self._inv_scale, self._scalars = 1.0, None, None
        return loss

    def _sync_hyperparameters(self) -> None:
        for bucket in self._buckets:
            for inner_group, gi in zip(bucket.inner.param_groups, bucket.group_of, strict=True):
                inner_group.update(self._hyperparameters(gi))

    def _step_bucket(self, bucket: _Bucket, h2d_done: torch.cuda.Event | None, copy_back: bool,
                     multiplier: float | torch.Tensor = 1.0, found: torch.Tensor | None = None) -> None:
        if found is not None and found.item():
            return  # an inf/nan gradient (fp16 overflow): skipped, weights and state untouched, nothing to copy
        if h2d_done is not None:
            h2d_done.synchronize()  # the previous copies back read the masters (and casts) we are about to overwrite
        with torch.no_grad():
            if isinstance(multiplier, torch.Tensor) or multiplier != 1.0:
                grads = [s.master.grad for s in bucket.slots if s.master.grad is not None]
                if grads:
                    # The normalisation, the fp16 unscale and the clip coefficient as one fp32 multiply, inside the
                    # step, bucket by bucket on the worker (the loop's thread makes no pass). NOTE: not fused
                    # AdamW's grad_scale: it divides by it (g / (1/c) is not g * c in float), which moved gpt-tiny's
                    # weights 1e-4 from torch's in 8 steps at lr 1e-2; a multiply by torch's coefficient is
                    # bit-identical to torch's clip.
                    torch._foreach_mul_(grads, torch.as_tensor(multiplier, dtype=torch.float64).float())
            bucket.inner.step()
            # Cast on the CPU, here on the worker: the device dtype's bytes cross PCIe, and with delayed_update the
            # loop's thread then only launches the copies at the next step().
            for slot in bucket.slots:
                if slot.cast is not None:
                    slot.cast.copy_(slot.master)
            if copy_back:
                self._copy_to_device(bucket.slots)

    def _copy_to_device(self, slots: list[_Slot]) -> None:
        """Launches the copies of the (already cast) new weights into the device parameters, on the side stream."""
        self.link_bytes["host_to_device"] += sum(s.device.numel() * s.device.element_size() for s in slots)
        with torch.no_grad(), self._side_stream("host_to_device"):
            # One call for the lot: a per-tensor Python loop costs several microseconds a tensor on the loop's thread.
            torch._foreach_copy_([s.device for s in slots], [s.master if s.cast is None else s.cast for s in slots],
                                 non_blocking=True)

    def _after_copies(self) -> None:
        h2d = self._streams["host_to_device"]
        if h2d is not None:
            self._h2d_done = torch.cuda.Event()
            self._h2d_done.record(h2d)
            # The next forward reads the new weights: order it after the copies (the GPU waits, not the host).
            torch.cuda.current_stream(self.device).wait_stream(h2d)

    def _finish_update(self) -> None:
        if self._update is None:
            return
        for future in self._update:
            future.result()
        self._update = None
        if self._streams["host_to_device"] is not None:
            # The next backward read the old weights on the compute stream: the copies back wait for it (not for
            # the gradient copies, on the other side stream).
            self._streams["host_to_device"].wait_stream(torch.cuda.current_stream(self.device))
        self._copy_to_device(self._slots)
        self._after_copies()

    def synchronize(self) -> None:
        """Finishes a delayed update and copies its weights to the device (no-op without delayed_update)."""
        self._finish_update()

    def master_weights(self) -> dict[int, torch.Tensor]:
        """``id(parameter)`` -> its fp32 master on the host (finished updates included): the weights to save
        where the device holds bf16 copies (``device_dtype``)."""
        self._finish_update()
        return {id(slot.device): slot.master for slot in self._slots}

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._early:
            raise MemtrainError(
                f"zero_grad() after a backward armed by step_in_next_backward() that already stepped "
                f"{len(self._early)} bucket(s): the others would never be stepped. To resolve this error, call "
                "step() before zero_grad().")
        self._flush_landings()
        for future in self._landings:
            future.result()  # a pending add must not land in a buffer we are resetting
        self._landings.clear()
        self._norms_in_backward = False
        self._grad_factor, self._inv_scale, self._scalars = 1.0, None, None
        for slot in self._slots:
            slot.landings = 0
            if set_to_none:
                slot.has_grad = False
            elif slot.has_grad:
                slot.grads[self._buffer].zero_()
                slot.zeroed, slot.norm = True, None
            if self._update is None:
                slot.master.grad = None  # only once no CPU step reads it (delayed_update)
        self._gathered = False
        super().zero_grad(set_to_none=set_to_none)  # the device gradients (offload_gradients=False)

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The host state, in torch's format, keyed by parameter name (by index without names).

        Loadable by a plain ``optimizer_class`` over the same parameters (``torch.optim.AdamW(model.parameters())
        .load_state_dict(...)``). Tensors are copies (the live ones are views of shared flat buffers, which
        safetensors refuses and torch.save would write whole). With non-fp32 device weights each entry also
        holds ``master_weight``, the fp32 master, so a resumed run continues bit-identically.
        """
        self.synchronize()
        state: dict[int | str, dict[str, Any]] = {}
        groups = []
        for gi, group in enumerate(self.param_groups):
            slots = [s for s in self._slots if s.group == gi]
            saved = {k: v for k, v in group.items() if k != "params"}
            # torch's load_state_dict replaces a group with the saved one: keep our kernel choice in it as torch
            # itself would, or a plain optimizer loading this would silently fall back to its slowest kernel.
            saved.update({k: v for k, v in self._buckets[0].inner.defaults.items() if k in IMPLEMENTATION_KEYS})
            saved["params"] = [s.key for s in slots]
            groups.append(saved)
            for slot in slots:
                entry = self.state.get(slot.device)
                if entry:
                    state[slot.key] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                    if slot.device.dtype != torch.float32:
                        state[slot.key]["master_weight"] = slot.master.clone()
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of a plain ``optimizer_class`` (e.g. a device AdamW's).

        Entries are matched by parameter name when both sides have names (``param_names``), else by position.
        The fp32 masters are re-read from the device parameters (or from ``master_weight``), so load the model's
        weights first.
        """
        self.synchronize()
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ConfigError(f"the state_dict has parameter groups of sizes {saved_sizes}, this optimizer "
                              f"{sizes}. To resolve this error, build the optimizer over the same parameters.")
        by_key = self._match_keys(saved_groups)
        problems = []
        for key, entry in state_dict["state"].items():
            slot = by_key.get(key)
            if slot is None:
                problems.append(f"state entry {key!r} belongs to no parameter of the state_dict's param_groups.")
                continue
            shapes = {k: tuple(v.shape) for k, v in entry.items() if isinstance(v, torch.Tensor) and v.ndim > 0}
            wrong = {k: shape for k, shape in shapes.items() if shape != tuple(slot.master.shape)}
            if wrong:
                problems.append(f"state of {key!r} has shapes {wrong}, the parameter {tuple(slot.master.shape)}.")
        if problems:
            problems[-1] += " To resolve this error, load a state_dict saved for the same model and parameter order."
        ConfigError.raise_if(problems)
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names", *IMPLEMENTATION_KEYS)})
        for bucket in self._buckets:
            bucket.inner.state.clear()
        fp32_state = type(self._buckets[0].inner) in STATE_BYTES_PER_PARAM
        for slot in self._slots:
            slot.master.copy_(slot.device.detach())
        for key, entry in state_dict["state"].items():
            slot = by_key[key]
            owner = next(b for b in self._buckets if slot in b.slots)
            entry = dict(entry)
            master = entry.pop("master_weight", None)
            if master is not None:
                slot.master.copy_(master)
            # The host kernels need CPU tensors, fp32 for torch's own optimizers (a fused/capturable device optimizer
            # keeps "step" on the GPU); other classes keep their state's dtypes (bf16 moments, 8-bit codes).
            owner.inner.state[slot.master] = {
                k: (v.detach().to("cpu", torch.float32 if fp32_state else v.dtype, copy=True)
                    if isinstance(v, torch.Tensor) else v)
                for k, v in entry.items()
            }
        self._link_state()

    def _match_keys(self, saved_groups: list[dict[str, Any]]) -> dict[Any, _Slot]:
        saved_keys = [k for g in saved_groups for k in g["params"]]
        ours = [s for gi in range(len(self.param_groups)) for s in self._slots if s.group == gi]
        saved_names = [n for g in saved_groups for n in g.get("param_names", [])]
        if len(saved_names) == len(saved_keys) and all(isinstance(s.key, str) for s in ours):
            by_name = {s.key: s for s in ours}
            missing = sorted(set(saved_names) - set(by_name))
            if missing:
                raise ConfigError(f"the state_dict names parameters this optimizer does not have: {missing[:5]}. "
                                  "To resolve this error, build the optimizer over the same named parameters.")
            return {k: by_name[n] for k, n in zip(saved_keys, saved_names, strict=True)}
        return dict(zip(saved_keys, ours, strict=True))

    def close(self) -> None:
        """Removes the gradient hooks and stops the worker thread (after finishing any pending work). The
        parameters may then be given to another optimizer."""
        self.synchronize()
        self._finalizer()  # runs _release once


def _release(hooks: list[Any], worker: ThreadPoolExecutor, params: list[torch.Tensor]) -> None:
    for handle in hooks:
        handle.remove()
    for p in params:
        entry = _OWNERS.get(id(p))
        if entry is not None and entry[0]() is p:
            del _OWNERS[id(p)]
    worker.shutdown(wait=False)


# Each parameter's optimizer, weakly both ways (keyed by id: tensors compare by value, not identity). A second live
# optimizer over the same parameter is refused.
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[CPUOffloadOptimizer]]] = {}


def _owner(p: torch.Tensor) -> CPUOffloadOptimizer | None:
    entry = _OWNERS.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def _claim(p: torch.Tensor, optimizer: CPUOffloadOptimizer) -> None:
    key = id(p)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:  # the parameter is gone
        if _OWNERS.get(key, (None,))[0] is ref:
            del _OWNERS[key]

    _OWNERS[key] = (weakref.ref(p, forget), weakref.ref(optimizer))


_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_DIRECTIONS = ("device_to_host", "host_to_device")


def _host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A flat host tensor, page-locked when ``pin`` (so copies to and from the GPU are asynchronous DMA).

    Registers an ordinary allocation with cudaHostRegister: torch's pinned allocator rounds each request up to a
    power of two (a 4.4 GB buffer would pin 8 GB). The registration lives as long as the tensor's memory.
    """
    buffer = torch.empty(numel, dtype=dtype)
    if not pin or numel == 0:
        return buffer
    cudart = torch.cuda.cudart()
    register = getattr(cudart, "cudaHostRegister", None)
    if register is None:
        return buffer.pin_memory()
    # On a throwaway thread: a refused registration leaves the CUDA runtime's per-thread "last error" set, which
    # the next kernel launch's error check on that thread would report as its own failure. A new thread starts on
    # device 0: it is set to this process's device first (no context on GPU 0 for every rank), and the memory is
    # registered as portable (page-locked for every device's context, as torch's own host registration does).
    device = torch.cuda.current_device()

    def register_here() -> int:
        torch.cuda.set_device(device)
        return int(register(buffer.data_ptr(), numel * buffer.element_size(), _CUDA_HOST_REGISTER_PORTABLE))

    with ThreadPoolExecutor(max_workers=1) as once:
        status = once.submit(register_here).result()
    if status != 0:
        # NOTE: registration refused (e.g. a locked-memory limit): the allocator's way, rounded up.
        return buffer.pin_memory()
    weakref.finalize(buffer.untyped_storage(), cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def bucket_runs(numels: list[int], bucket_numel: int) -> list[list[int]]:
    """How CPUOffloadOptimizer groups parameters (given in its bucket order) into buckets: runs of indices whose
    numels add up to at most ``bucket_numel`` (a larger parameter gets a bucket of its own). Pure, for byte models."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(numels):
        if runs[-1] and total + n > bucket_numel:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return runs


def _aligned(numel: int) -> int:
    # Every view starts on a 256-byte boundary: the CPU kernels' vector loops then split each tensor the same way
    # as for a separately allocated one, so the rounding (and the result) is bit-identical to a plain optimizer.
    return -(-numel // 64) * 64


def _finish_landings(landings: list[_Landing], event: torch.cuda.Event | None) -> None:
    """Worker side of one bucket's gradient copies: wait for the transfers, add (or cast) each staged gradient,
    then take the norms asked for (of the sum, after a parameter's last landing in the list)."""
    if event is not None:
        event.synchronize()
    last: dict[int, _Landing] = {}
    with torch.no_grad():
        for landing in landings:
            if landing.staged is not None:
                if landing.copy:
                    landing.dst.copy_(landing.staged)
                else:
                    landing.dst.add_(landing.staged)
            last[id(landing.slot)] = landing
        for landing in last.values():
            # A landing that takes no norm drops the one of an earlier landing: it no longer matches the sum.
            landing.slot.norm = torch.linalg.vector_norm(landing.dst, 2.0) if landing.want_norm else None


# -- validation ---------------------------------------------------------------------------------------------
def _parse_params(params: Iterable[Any], optimizer_class: Any) -> tuple[list[dict[str, Any]], list[str] | None]:
    """Normalises params into groups of plain tensors and names (None unless every parameter is named)."""
    problems = []
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer_class={optimizer_class!r} is not a torch.optim.Optimizer subclass. To resolve "
                          "this error, pass a class such as torch.optim.AdamW (the class, not an instance).")
    if isinstance(params, torch.Tensor):
        params = [params]
    items = list(params)
    raw_groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    groups: list[dict[str, Any]] = []
    names: list[str | None] = []
    for g in raw_groups:
        if not isinstance(g, dict):
            raise ConfigError("params mixes parameter groups (dicts) with parameters. To resolve this error, pass "
                              "either a list of parameters or a list of groups.")
        entries = [g["params"]] if isinstance(g.get("params"), torch.Tensor) else list(g.get("params", []))
        tensors = []
        for e in entries:
            name, p = (e if isinstance(e, tuple) and len(e) == 2 else (None, e))
            tensors.append(p)
            names.append(name)
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": tensors})
    flat = [p for g in groups for p in g["params"]]
    if not flat:
        raise ConfigError("CPUOffloadOptimizer got no parameters. To resolve this error, pass model.parameters() "
                          "(check that the model has parameters and that a generator was not consumed before).")
    label = [str(n) if n is not None else f"#{i}" for i, n in enumerate(names)]
    not_tensors = [lbl for lbl, p in zip(label, flat, strict=True) if not isinstance(p, torch.Tensor)]
    if not_tensors:
        raise ConfigError(f"params {not_tensors[:5]} are not tensors. To resolve this error, pass model.parameters() "
                          "or model.named_parameters().")
    frozen = [lbl for lbl, p in zip(label, flat, strict=True) if not p.requires_grad]
    if frozen:
        problems.append(f"{len(frozen)} parameters do not require grad ({frozen[:5]}): they would take host buffers "
                        "and never get a gradient. To resolve this error, pass only trainable ones: "
                        "[p for p in model.parameters() if p.requires_grad].")
    devices = sorted({str(p.device) for p in flat})
    if len(devices) > 1:
        problems.append(f"the parameters live on several devices ({', '.join(devices)}); one set of streams and "
                        "buffers serves one device. To resolve this error, build one CPUOffloadOptimizer per device.")
    not_float = sorted({str(p.dtype) for p in flat if not p.is_floating_point()})
    if not_float:
        problems.append(f"parameters of dtype {not_float} cannot be optimized. To resolve this error, pass floating-"
                        "point parameters only.")
    if any(p.layout != torch.strided for p in flat):
        problems.append("sparse parameters are not supported. To resolve this error, use dense parameters.")
    if len({id(p) for p in flat}) != len(flat):
        problems.append("a parameter appears more than once in params: it would get two host copies and two "
                        "gradient hooks. To resolve this error, pass each parameter once (model.parameters() "
                        "already lists tied weights once).")
    owned = [lbl for lbl, p in zip(label, flat, strict=True) if _owner(p) is not None]
    if owned:
        problems.append(f"parameters {owned[:5]} already belong to another live CPUOffloadOptimizer, whose hooks "
                        "take their gradients in backward. To resolve this error, call old_optimizer.close() first.")
    ConfigError.raise_if(problems)
    named = all(n is not None for n in names)
    return groups, ([str(n) for n in names] if named else None)


def _group_indices(groups: list[dict[str, Any]]) -> list[list[int]]:
    out, i = [], 0
    for g in groups:
        out.append(list(range(i, i + len(g["params"]))))
        i += len(g["params"])
    return out


def host_buffer_bytes(flat: list[torch.Tensor], *, n_grad_buffers: int,
                      device_dtype: torch.dtype | None = None) -> int:
    """Bytes of CPUOffloadOptimizer's host buffers over ``flat`` (state aside): fp32 masters, the gradient
    buffers, and for parameters whose device dtype is not fp32 a cast buffer and a gradient stage in that dtype."""
    numel = sum(_aligned(p.numel()) for p in flat)
    cast = 0
    for p in flat:
        dtype = device_dtype if device_dtype is not None and p.is_floating_point() else p.dtype
        if dtype != torch.float32:
            cast += _aligned(p.numel()) * torch.empty((), dtype=dtype).element_size()
    return 4 * numel * (1 + n_grad_buffers) + 2 * cast


def _check_host_ram(flat: list[torch.Tensor], optimizer_class: type, *, n_grad_buffers: int, pin: bool,
                    device_dtype: torch.dtype | None = None) -> None:
    """Raises before allocating when the host buffers would not fit in the machine's available RAM."""
    numel = sum(_aligned(p.numel()) for p in flat)
    per_param = getattr(optimizer_class, "state_bytes_per_param", None)  # memtrain.optim's lean classes say theirs
    state = int(STATE_BYTES_PER_PARAM.get(optimizer_class, per_param or 8) * numel)
    need = host_buffer_bytes(flat, n_grad_buffers=n_grad_buffers, device_dtype=device_dtype) + state
    available = available_host_bytes()
    if available is not None and need > available:
        raise MemtrainError(
            f"CPUOffloadOptimizer needs {format_bytes(need)} of host RAM ({numel:,} parameters: fp32 master weights "
            f"and {n_grad_buffers} gradient buffer(s){', pinned' if pin else ''} (and cast and gradient stage buffers "
            f"for non-fp32 device weights), plus about {format_bytes(state)} "
            f"of {optimizer_class.__name__} state), but only {format_bytes(available)} is available. To resolve "
            "this error, free host memory, train fewer parameters, or keep the optimizer on the device.")

