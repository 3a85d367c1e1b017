"""CPUOffloadOptimizer: optimizer state and fp32 master weights on the CPU, the step overlapped with GPU work.

Trade-off: the device keeps only the weights (and, briefly, each gradient), saving 12 bytes per parameter for
AdamW with fp32 weights (8 of state + 4 of gradient), at the cost of a CPU optimizer step and two PCIe transfers
per step, which run on a worker thread and a side stream so that they hide behind GPU work. The host holds the
fp32 master (4 bytes per parameter), a gradient buffer (4) and AdamW's moments: fp32 (8), or with
``state_precision`` bf16 (4) or block-wise int8 (about 2.03). The CPU step is one fused pass over each tensor's
memory (``memtrain.optim.host_kernels``; ``memory.cpu_step_rate`` measures it, ``memtrain bench host_step`` compares
it with torch's fused fp32 AdamW).

How a step flows:

- backward: a post-accumulate-grad hook copies each gradient device -> host on a side stream as soon as autograd
  has produced it and frees the device gradient. A second micro-batch's gradient lands in a pinned sum stage (two
  halves filled in turn) and is added into the host buffer, so gradient accumulation needs no change to the loop.
  The host side of the landings (waiting for the copies, adding, casting) is handed to a landing thread once per
  bucket: one event and one task per bucket, never queued behind a CPU step (on the step's own thread).
- ``scale_gradients_(factor)`` and ``clip_grad_norm_(max_norm)`` (optional) make no pass over the host gradients:
  the factor, the fp16 inverse scale and the clip coefficient become one multiplier that the CPU step applies to
  each bucket just before stepping it, on the worker; the global norm (as ``torch.nn.utils.clip_grad_norm_``
  computes it, within float rounding after ``scale_gradients_``) comes from the per-tensor norms the worker took
  as the gradients landed during the window's last backward, which ``next_backward_is_last()`` announces
  (``GradientAccumulator`` calls it on the micro-batch marked ``is_last``); loops of one backward per step get
  them without it, after their first clip.
- ``step()``: after ``clip_grad_norm_`` or with a ``GradScaler`` attached, a non-finite norm (an overflow) skips
  the step on the worker, weights and state untouched; otherwise the wrapped optimizer steps bucket by bucket on
  the worker thread, and each bucket's weights go back host -> device (in the device parameter's dtype) on the
  host->device side stream while the next bucket steps; the gradients came down on the other side stream. The
  host step is a part the offloader has (``HostStepper``, ``memtrain.optim.host_stepper``), as are the landings
  (``GradientLanding``), the lazy multiplier (``HostGradients``) and the checkpoint conversion
  (``OffloadCheckpoint``).
- ``step_in_next_backward()`` (no clipping, no fp16 scaler): the next backward steps each bucket as soon as its
  last gradient lands, so the CPU step overlaps the rest of backward.
- ``delayed_update=True``: ``step()`` returns at once and the CPU step runs during the next forward and backward
  (see the class docstring for the exact semantics).

Every stream, event, copy and pinned buffer goes through the device seam (``memtrain.device.accelerator``): on the
plain CPU the same code runs with no streams and no pinned memory; on the simulated accelerator the side streams
run behind and poison what is read before it is waited (tests/test_optim_simulated.py). Pinned memory is a few
slabs registered at their exact size (``pinned_bytes``, what the host-RAM check counted).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from memtrain.device import Accelerator, accelerator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.message import arg
from memtrain.optim.gradient_landing import GradientLanding
from memtrain.optim.host_buffers import (
    IMPLEMENTATION_KEYS,
    STATE_BYTES_PER_PARAM,
    Link,
    Slot,
    check_bf16_weights,
    check_host_ram,
    claim,
    group_indices,
    host_work,
    lay_out,
    make_buckets,
    own_stages,
    parse_params,
    probe_class,
    release,
    sum_stage_numel,
)
from memtrain.optim.host_gradients import HostGradients
from memtrain.optim.host_stepper import HostStepper
from memtrain.optim.moments import check_precision, state_class
from memtrain.optim.offload_checkpoint import OffloadCheckpoint
from memtrain.optim.pure_bf16 import PURE_STATE_BYTES, PureBF16AdamW, check_pure_bf16_moments
from memtrain.techniques.optimizer import (
    GRADIENTS_BEFORE_DDP,
    NAMED_OWN_STATE,
    NamedOptimizer,
    StatePrecision,
)


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
        state_precision: AdamW's moments on the host: "fp32" (8 bytes per parameter; ``optimizer_class`` as given),
            "bf16" (4: ``BF16StateAdamW``, stochastic rounding) or "int8" (about 2.03: bitsandbytes' block-wise
            8-bit AdamW on CPU tensors, the ``lowbit`` extra; tensors under 4,096 elements keep fp32 moments). The
            master weights stay fp32 and the update is computed in fp32 either way; "bf16" and "int8" need
            ``optimizer_class`` AdamW. Host bytes per parameter (fp32 weights on the device, no delayed update):
            16 with fp32 moments, 12 with bf16, about 10 with int8 (master 4, gradient buffer 4, moments).
        pure_bf16: True keeps no fp32 master: the (bf16) device weights' host copies are the weights themselves, in
            bf16, stepped by ``PureBF16AdamW`` (the update in fp32, rounded stochastically), with bf16 gradient
            buffers and moments of ``state_precision`` "bf16" or "fp32": 8 or 12 bytes per parameter of host RAM
            instead of 16-20, and bf16 both ways over the link. The parameters must be bf16 already.
        grad_scaler: the fp16 ``torch.amp.GradScaler`` in use, if any: ``step()`` then unscales the host
            gradients and checks them for inf/NaN itself (``scaler.unscale_(optimizer)`` cannot see gradients on
            the host: call ``optimizer.clip_grad_norm_`` instead; ``scaler.step``/``scaler.update`` work as usual).
        device: where the parameters train (None: where the first one is). Give it when the optimizer is built
            from host weights before the model is placed (``apply_plan`` does: the device then never holds the
            fp32 weights): the streams, pinned buffers and copies are that device's.
        salt_start: the first salt of the bf16 rounding noise (bf16 moments, pure bf16): each parameter's is
            ``salt_start`` plus its place in param_groups, fresh or loaded. ``ComposedOptimizer`` passes its device
            part's parameter count, so that no device and host parameter share a salt (the same noise).
        **optimizer_kwargs: hyper-parameters of ``optimizer_class`` (lr, betas, weight_decay, ...).

    Raises:
        ConfigError: no parameters, several devices, parameters that do not require grad, a class that is not a
            torch optimizer, hyper-parameters it does not accept, an unknown ``state_precision`` or lean moments
            with a class other than AdamW (int8 without bitsandbytes too, naming the ``lowbit`` extra).
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
        state_precision: StatePrecision = "fp32",
        pure_bf16: bool = False,
        device: torch.device | str | None = None,
        salt_start: int = 0,
        **optimizer_kwargs: Any,
    ):
        self.pure_bf16 = pure_bf16
        if pure_bf16:
            optimizer_class = _pure_bf16_class(optimizer_class, state_precision, device_dtype, optimizer_kwargs)
        else:
            optimizer_class = _moments_class(optimizer_class, state_precision)  # before anything is allocated
        self.state_precision = state_precision
        groups, names = parse_params(params, optimizer_class)
        flat = [p for g in groups for p in g["params"]]
        if pure_bf16:
            check_bf16_weights(flat, names)
        self.device = torch.device(device) if device is not None else flat[0].device
        # Every stream, event, copy and pinned buffer goes through the device's seam; a device without streams (the
        # plain CPU) runs the same code with none, and nothing to pin.
        self._acc = accelerator(self.device)
        pin = self._acc.has_streams  # pinned memory makes D2H/H2D copies asynchronous
        _check_gradients_after_sync(offload_gradients)
        self.offload_gradients = offload_gradients
        self.grad_scaler = grad_scaler
        if (optimizer_class in (torch.optim.Adam, torch.optim.AdamW)
                and "fused" not in optimizer_kwargs and "foreach" not in optimizer_kwargs):
            optimizer_kwargs["fused"] = True  # the fused CPU kernel: several times the for-loop's throughput
        master_dtype = torch.bfloat16 if pure_bf16 else torch.float32
        state_per_param = PURE_STATE_BYTES[state_precision] if pure_bf16 else _measured_state(
            optimizer_class, optimizer_kwargs, flat)
        buffer_bytes = check_host_ram(
            flat, optimizer_class, n_grad_buffers=2 if delayed_update else 1, pin=pin, device_dtype=device_dtype,
            master_dtype=master_dtype, state_bytes_per_param=state_per_param)
        # The bytes pinned: the buffers check_host_ram counted, registered at their exact size (stream_weights'
        # stages add theirs; the landings' sum stage is counted by its owner, see pinned_bytes).
        self._pinned_bytes = buffer_bytes if pin else 0
        # Where a later micro-batch's gradient lands before it is added (where copies are asynchronous).
        sum_numel = sum_stage_numel([p.numel() for p in flat], self.bucket_numel) if pin and offload_gradients else 0
        template = probe_class(optimizer_class, groups, optimizer_kwargs)  # before allocating gigabytes
        slots, order = lay_out(flat, groups, names, n_grad_buffers=1 + delayed_update, device_dtype=device_dtype,
                               acc=self._acc, master_dtype=master_dtype)
        self._slots = [slots[i] for i in range(len(flat))]  # in param_groups order, as torch iterates them
        self._init_param_groups(template, groups, names)
        self._buckets = make_buckets([slots[i] for i in order], self._slots, self.param_groups, optimizer_class,
                                     optimizer_kwargs, self.bucket_numel, first_salt=salt_start)
        self._link_state()
        # One side stream per direction of the link: the copies back (host -> device) of a delayed update then run
        # beside the next backward's gradient copies (device -> host) instead of queueing behind them, and the two
        # PCIe directions overlap. The landings and the stepper share it.
        self._link = Link(self._acc, streams=pin)
        self._streams = self._link.streams
        # Bytes that crossed (or, on a CPU-only run, would cross) the host link, per direction, over the run.
        self.link_bytes = self._link.bytes
        self._gathered = False  # this step's gradients are on the host, attached, unscaled
        self._found_inf: torch.Tensor | None = None  # an inf check made by GradScaler on the device (unscale_)
        self._stepper = HostStepper(self._slots, self._buckets, link=self._link, delayed=delayed_update)
        self._landing = GradientLanding(self._slots, self._buckets, link=self._link, sum_numel=sum_numel)
        self._grads = HostGradients(self._slots)
        self._checkpoint = OffloadCheckpoint(self._slots, self._buckets, state_precision, salt_start=salt_start)
        self._hooks = [s.device.register_post_accumulate_grad_hook(self._make_hook(s)) for s in self._slots]
        for slot in self._slots:
            claim(slot.device, self)
        # An optimizer that is dropped without close() must not keep taking gradients: the hooks hold it weakly,
        # and this removes them (and stops the worker) once it is collected.
        self._finalizer = weakref.finalize(self, release, list(self._hooks),
                                           (self._stepper.worker, self._landing.worker), [s.device for s in self._slots])

    # -- what ComposedOptimizer's parts and the benchmarks read (read-only) ---------------------------------------
    @property
    def slots(self) -> list[Slot]:
        """The host views of each parameter (master, gradient buffers, cast), in param_groups order: read them,
        do not replace them (the buckets, hooks and landings hold the same objects)."""
        return self._slots

    @property
    def host_gradients(self) -> HostGradients:
        """The lazy multiplier of this step's host gradients (normalisation, fp16 inverse scale, clip coefficient)
        that the host step applies: ComposedOptimizer's host part joins its own inverse scale and clip to it."""
        return self._grads

    @property
    def accelerator(self) -> Accelerator:
        """The device seam every copy, stream, event and pinned buffer of this optimizer goes through."""
        return self._acc

    @property
    def delayed_update(self) -> bool:
        """Whether ``step()`` leaves the CPU step in flight for the next one (the constructor's ``delayed_update``):
        the stepper's setting, read-only (the host buffers were sized for it)."""
        return self._stepper.delayed

    @property
    def stepper(self) -> HostStepper:
        """The host step (its buckets and worker thread): for benchmarks that time the CPU step alone."""
        return self._stepper

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory pinned: the buffers the host-RAM check counted, stream_weights' stages and, once a
        later micro-batch landed, the sum stage."""
        return self._pinned_bytes + self._landing.pinned_bytes

    @property
    def manages_gradients(self) -> bool:
        """Whether this step's gradients live in host memory, not in ``p.grad`` (``offload_gradients``): the
        accumulator then normalises and clips through ``scale_gradients_`` and ``clip_grad_norm_``. ComposedOptimizer
        exposes the same attribute."""
        return self.offload_gradients

    # With a grad_scaler attached, step() takes the inf check from the host gradients' norm, readable before the
    # step as found_inf_flag (once clip_grad_norm_ gathered them), skips on it and writes it back for
    # scaler.update(): GradientAccumulator calls step() itself, not scaler.step(optimizer). ComposedOptimizer says False.
    found_inf_before_step = True

    def _init_param_groups(self, template: torch.optim.Optimizer, groups: list[dict[str, Any]],
                           names: list[str] | None) -> None:
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
            for g, ids in zip(self.param_groups, group_indices(groups), strict=True):
                g["param_names"] = [names[i] for i in ids]

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


    # -- backward: the hooks hand each gradient to the landings --------------------------------------------------
    def _make_hook(self, slot: Slot) -> Callable[[torch.Tensor], None]:
        # The hook holds the optimizer weakly: one dropped without close() is collected (and its finalizer removes
        # the hooks) instead of being kept alive by its parameters.
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
                ready = self._landing.land(slot, free=True)
                if ready is not None:
                    # step_in_next_backward: the bucket's gradients all landed; it steps on the worker, behind
                    # the landing task that completes them.
                    self._landing.early[ready] = self._stepper.step_early(ready, self._landing.last_task())
        return hook

    def next_backward_is_last(self) -> None:
        """Says that the next backward is the last of the accumulation window (the one before
        ``clip_grad_norm_``/``step()``): the worker takes each gradient's norm as it lands in it, so that the clip
        reads no gradient again. ``GradientAccumulator`` calls it on the micro-batch marked ``is_last=True``.

        Without it, a loop of one backward per step gets the same after its first clip; a window of several
        backwards then takes the norms at ``clip_grad_norm_`` (one more pass over the host gradients).
        """
        self._landing.norms_in_backward = True

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
        self._stepper.sync_hyperparameters(self.param_groups)
        self._landing.arm()

    # -- the step -----------------------------------------------------------------------------------------------
    def gather_gradients(self) -> None:
        """Makes this step's gradients ready on the host: landed, attached to the masters (``.grad``), the fp16
        inverse scale handed to the host step's multiplier (no pass over them).

        Call it after the window's last backward and before reading or changing the host gradients; it does its
        work once a step (later calls return at once until ``step()`` or ``zero_grad()``)."""
        if self._gathered:
            return
        self._stepper.finish_update()  # delayed_update: the previous CPU step reads the masters' .grad until it is done
        if not self.offload_gradients:
            for slot in self._slots:
                self._landing.land(slot, free=False)
        self._landing.wait()  # buckets holding a parameter that got no gradient too; re-raises a worker error here
        for slot in self._slots:
            slot.master.grad = slot.grads[self._landing.buffer] if slot.has_grad else None
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
            # multiplier the host step divides by, and the inf check is the norm's (see HostGradients).
            self._grads.inv_scale = self.grad_scaler._scale.double().reciprocal().float().to("cpu", copy=True)
        self._gathered = True

    def _check_unscaled_on_device(self) -> None:
        if self.offload_gradients:
            raise MemtrainError(
                "scaler.unscale_(optimizer) was called, but CPUOffloadOptimizer's gradients live on the host where "
                "the scaler cannot see them: they would stay scaled. To resolve this error, remove "
                "scaler.unscale_(optimizer) and call optimizer.clip_grad_norm_(max_norm), which unscales first (or "
                "build the optimizer with offload_gradients=False to keep gradients on the device).")

    # -- host gradients: normalised, clipped and checked with no pass over them (HostGradients) ------------------
    @host_work
    def gradients(self) -> list[torch.Tensor]:
        """This step's host gradients (landed, unscaled, normalised by ``scale_gradients_``), in param_groups
        order, for in-place edits.

        For code that must change gradients before the step (e.g. normalising an accumulated sum by the token
        count): ``[p.grad for p in model.parameters()]`` finds nothing once gradients are offloaded. This applies
        the pending multiplier (one pass; ``scale_gradients_`` and ``clip_grad_norm_`` make none).
        """
        self.gather_gradients()
        return self._grads.apply()

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
        if self._landing.waiting is not None:
            raise MemtrainError(
                "scale_gradients_ after step_in_next_backward(): buckets were already stepped (or are stepping) with "
                "these gradients, so scaling them now changes nothing in this update. To resolve this error, drop "
                "step_in_next_backward() when gradients need normalising (e.g. accumulation over token counts).")
        self.gather_gradients()
        self._grads.scale(factor)

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
        if self._landing.waiting is not None:
            raise MemtrainError(
                "clip_grad_norm_ after step_in_next_backward(): buckets were already stepped with unclipped gradients "
                "during backward. To resolve this error, drop step_in_next_backward() when clipping (or use "
                "delayed_update=True to hide the CPU step).")
        self.gather_gradients()
        landed = self._grads.landed()
        # A window of one backward: from now on the worker takes the norm of each first landing (the last one,
        # in such loops).
        self._landing.norms_on_first_landing = bool(landed) and all(s.landings == 1 for s in landed)
        return self._grads.clip(max_norm, norm_type)

    @property
    def found_inf_flag(self) -> torch.Tensor | None:
        """This step's inf/nan flag (a host tensor, 1.0 when the step will be skipped), once the gradients are
        gathered (``clip_grad_norm_`` or ``step``): a non-finite norm, which an fp16 overflow gives."""
        return self._grads.found_inf() if self._gathered else None

    # -- checkpoints (OffloadCheckpoint) -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The host state, in torch's format, keyed by parameter name (by index without names).

        Loadable by a plain ``optimizer_class`` over the same parameters (``torch.optim.AdamW(model.parameters())
        .load_state_dict(...)``). Tensors are copies (the live ones are views of shared flat buffers, which
        safetensors refuses and torch.save would write whole). With non-fp32 device weights each entry also
        holds ``master_weight``, the fp32 master, so a resumed run continues bit-identically.
        """
        self.synchronize()
        return self._checkpoint.state_dict(self.param_groups, self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of a plain ``optimizer_class`` (e.g. a device AdamW's).

        Entries are matched by parameter name when both sides have names (``param_names``), else by position.
        The fp32 masters are re-read from the device parameters (or from ``master_weight``), so load the model's
        weights first.
        """
        self.synchronize()
        self._checkpoint.load_state_dict(state_dict, self.param_groups)
        self._link_state()

    def load_entries(self, same: dict[str, dict[str, Any]], converted: dict[str, tuple[Any, ...]],
                     masters: dict[str, torch.Tensor]) -> None:
        """ComposedOptimizer's load of its host part: AdamW entries by parameter name, already checked (see
        ``OffloadCheckpoint.load_entries``); every other parameter's state is dropped. The rounding of converted
        bf16 moments is salted as a fresh step salts it: from the constructor's ``salt_start``, in param_groups
        order (after the device part's parameters).

        Raises:
            ConfigError: a name in ``same``, ``converted`` or ``masters`` that is none of this optimizer's
                parameters (``slots``' keys).
        """
        keys = {slot.key for slot in self._slots}
        unknown = sorted({*same, *converted, *masters} - keys, key=str)
        if unknown:
            raise ConfigError(f"CPUOffloadOptimizer.load_entries: entries {unknown[:5]} name no parameter of this "
                              f"optimizer ({len(keys)} parameters, e.g. {sorted(keys, key=str)[:3]}). To resolve this "
                              "error, pass only the entries of its own parameters (the names of its slots' keys).")
        self.synchronize()
        self._checkpoint.load_entries(same, converted, masters)
        self._link_state()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Steps the wrapped optimizer on the host and copies the weights back (see the class docstring).

        Skips the update (weights and state untouched) when the attached grad_scaler found inf/NaN.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._start_step()
        return loss

    @host_work
    def _start_step(self) -> None:
        """step() after its closure: gathers the gradients, then starts (delayed_update) or runs the CPU step."""
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
        self.gather_gradients()
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
        multiplier, found = self._grads.for_step()
        if self._found_inf is not None:
            found = self._found_inf if found is None else torch.maximum(found, self._found_inf.to(found.device))
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            # NOTE: GradScaler has no public way to receive an inf check made elsewhere: scaler.update() reads it
            # from here to back off the scale. Written in step() because scaler.step() resets it before calling us.
            found = found if found is not None else torch.zeros(())
            self.grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {found.device: found}
        early = self._landing.disarm()
        self._stepper.sync_hyperparameters(self.param_groups)
        self._stepper.run(multiplier, found, early=early)
        if self.delayed_update:
            self._landing.buffer = 1 - self._landing.buffer  # the next backward writes the other host buffer
            for slot in self._slots:
                slot.has_grad = slot.zeroed = False
                slot.landings = 0
        self._gathered = False
        self._grads.reset()

    def stream_weights(self, params: Iterable[torch.Tensor], *,
                       fills_done: Callable[[], Any] | None = None) -> dict[int, torch.Tensor]:
        """Hands ``params``' host weights to parameter offload (``memtrain.offload.weights.WeightStreamer``):
        ``id(parameter)`` -> the host tensor holding its weights in the device dtype after every step (the fp32
        master, or its cast), which the streamer copies to the device each time its block is used. The step copies
        nothing back for them, and a cast gets a gradient stage of its own (2 bytes a bf16 parameter of host RAM,
        one pinned slab for all of them): the shared one would be written by gradients landing while backward
        still reads the cast.

        Args:
            params: the streamed parameters.
            fills_done: called on the loop's thread when a step starts (``step()``, or a bucket stepping in
                backward): returns an event of the device seam recorded after every fill of these weights the
                streamer has issued so far (None: none in flight). The step waits for it on the worker
                (``synchronize_event``) before it overwrites host weights that a fill may still be reading.

        Raises:
            ConfigError: a parameter this optimizer does not hold, or ``delayed_update`` (its step would write the
                host weights while the next forward reads them).
            MemtrainError: not enough free host RAM for the stages.
        """
        if self.delayed_update:
            raise ConfigError("CPUOffloadOptimizer(delayed_update=True) with parameter offload: the delayed step "
                              "writes the host weights while the next forward copies them to the device. To resolve "
                              "this error, pass delayed_update=False.")
        params = list(params)
        by_id = {id(s.device): s for s in self._slots}
        missing = [tuple(p.shape) for p in params if id(p) not in by_id]
        if missing:
            raise ConfigError(f"CPUOffloadOptimizer.stream_weights: {len(missing)} parameter(s) (shapes "
                              f"{missing[:3]}) are not this optimizer's. To resolve this error, pass parameters it "
                              "was built with.")
        slots = [by_id[id(p)] for p in params]
        shared = [s for s in slots if s.cast is not None and s.stage is not None
                  and s.stage.data_ptr() == s.cast.data_ptr()]
        self._pinned_bytes += own_stages(shared, self._acc)
        hosts = {}
        for p, slot in zip(params, slots, strict=True):
            if slot.cast is not None:
                slot.cast.copy_(slot.device.detach())  # written by steps only: until the first, the device's
            self._stepper.streamed.add(id(slot))
            hosts[id(p)] = slot.master if slot.cast is None else slot.cast
        if fills_done is not None:
            self.wait_for_fills(fills_done)
        return hosts

    def wait_for_fills(self, fills_done: Callable[[], Any] | None) -> None:
        """Sets ``stream_weights``' ``fills_done`` once the streamer exists (it is built from the host weights
        ``stream_weights`` returns): ``optimizer.wait_for_fills(streamer.fills_done)``. None: no wait."""
        self._stepper.fills_done = fills_done

    def synchronize(self) -> None:
        """Finishes a delayed update and copies its weights to the device (no-op without delayed_update)."""
        self._stepper.finish_update()

    def master_weights(self) -> dict[int, torch.Tensor]:
        """``id(parameter)`` -> its fp32 master on the host (finished updates included): the weights to save
        where the device holds bf16 copies (``device_dtype``)."""
        self._stepper.finish_update()
        return {id(slot.device): slot.master for slot in self._slots}

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._landing.early:
            raise MemtrainError(
                f"zero_grad() after a backward armed by step_in_next_backward() that already stepped "
                f"{len(self._landing.early)} bucket(s): the others would never be stepped. To resolve this error, call "
                "step() before zero_grad().")
        self._landing.wait()  # a pending add must not land in a buffer we are resetting
        self._grads.reset()
        for slot in self._slots:
            slot.landings = 0
            if set_to_none:
                slot.has_grad = False
            elif slot.has_grad:
                slot.grads[self._landing.buffer].zero_()
                slot.zeroed, slot.norm = True, None
            if self._stepper.in_flight is None:
                slot.master.grad = None  # only once no CPU step reads it (delayed_update)
        self._gathered = False
        super().zero_grad(set_to_none=set_to_none)  # the device gradients (offload_gradients=False)

    def close(self) -> None:
        """Removes the gradient hooks and stops the worker thread (after finishing any pending work). The
        parameters may then be given to another optimizer."""
        self.synchronize()
        self._finalizer()  # runs release once


def _check_gradients_after_sync(offload_gradients: bool) -> None:
    if offload_gradients and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # The tensor hook runs before DDP's reducer: the host would get this rank's unsynchronised gradient.
        raise ConfigError(GRADIENTS_BEFORE_DDP.message(
            f"CPUOffloadOptimizer(offload_gradients=True) with {dist.get_world_size()} ranks",
            fix="pass offload_gradients=False (they are copied at the step, after synchronisation)"))


def _measured_state(optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any],
                    flat: list[torch.Tensor]) -> float | None:
    """State bytes per parameter of a class memtrain has no figure for, measured by its probe steps over the
    parameters' shapes (fp32 masters); None for the classes whose figure is known."""
    if optimizer_class in STATE_BYTES_PER_PARAM or hasattr(optimizer_class, "state_bytes_per_param"):
        return None
    named = NamedOptimizer.of(optimizer_class, {k: v for k, v in optimizer_kwargs.items() if k != "lr"})
    numel = sum(p.numel() for p in flat)
    return sum(named.state_bytes(tuple(p.shape), torch.float32) for p in flat) / max(numel, 1)


def _moments_class(optimizer_class: type[torch.optim.Optimizer], state_precision: object) -> type[torch.optim.Optimizer]:
    """The host optimizer's class: ``optimizer_class`` for fp32 moments, else AdamW's with moments of
    ``state_precision`` on CPU tensors (``memtrain.optim.moments``)."""
    check_precision(state_precision)
    if state_precision == "fp32":
        return optimizer_class
    if optimizer_class is not torch.optim.AdamW:
        raise ConfigError(NAMED_OWN_STATE.message(
            f"CPUOffloadOptimizer(optimizer_class={getattr(optimizer_class, '__name__', optimizer_class)}, "
            f"state_precision={state_precision!r})",
            f"drop optimizer_class (AdamW), or pass {arg('state_precision', 'fp32')}"))
    return state_class(str(state_precision), "cpu")[0]


def _pure_bf16_class(optimizer_class: type[torch.optim.Optimizer], state_precision: object,
                     device_dtype: torch.dtype | None, optimizer_kwargs: dict[str, Any]) -> type[torch.optim.Optimizer]:
    """``PureBF16AdamW`` (its moments' precision set in ``optimizer_kwargs``) for ``pure_bf16=True``, after
    checking what it cannot combine with."""
    check_pure_bf16_moments(state_precision)
    if optimizer_class is not torch.optim.AdamW or device_dtype not in (None, torch.bfloat16):
        raise ConfigError(
            f"CPUOffloadOptimizer(pure_bf16=True) with optimizer_class="
            f"{getattr(optimizer_class, '__name__', optimizer_class)} and device_dtype={device_dtype}: pure bf16 "
            "steps bf16 weights with AdamW (no master to cast from). To resolve this error, drop optimizer_class "
            f"and device_dtype, or pass {arg('pure_bf16', False)}.")
    optimizer_kwargs["state_precision"] = state_precision
    return PureBF16AdamW
