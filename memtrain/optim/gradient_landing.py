"""The backward half of CPUOffloadOptimizer: gradients stream device -> host as autograd produces them.

A post-accumulate-grad hook copies each gradient to a host buffer on the device->host side stream and frees it on
the device; the host side of the landings (waiting for the copies, adding, casting, taking norms) goes to the
worker thread once per bucket. ``step_in_next_backward`` steps each bucket as soon as its last gradient lands.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from memtrain.device import Accelerator
from memtrain.errors import MemtrainError
from memtrain.optim.host_buffers import Bucket, Landing, Slot, SumStage, own_sum_stage


class GradientLanding:
    """CPUOffloadOptimizer's backward methods (a mixin: the attributes it reads are set up by
    ``CPUOffloadOptimizer.__init__``)."""

    if TYPE_CHECKING:
        device: torch.device
        offload_gradients: bool
        delayed_update: bool
        grad_scaler: torch.amp.GradScaler | None
        link_bytes: dict[str, int]
        _slots: list[Slot]
        _buckets: list[Bucket]
        _streams: dict[str, Any]
        _worker: Any
        _landing_worker: Any
        _landings: list[Future[None]]
        _pending: list[list[Landing]]
        _unlanded: list[set[int]]
        _buffer: int
        _norms_in_backward: bool
        _norms_on_first_landing: bool
        _waiting: list[set[int]] | None
        _early: dict[int, Future[None]]
        _h2d_done: Any
        _acc: Accelerator
        _sum_stage: SumStage | None
        _sum_numel: int
        pinned_bytes: int

        def _step_bucket(self, bucket: Bucket, h2d_done: Any, copy_back: bool,
                         multiplier: float | torch.Tensor = 1.0, found: torch.Tensor | None = None, *,
                         landed: Future[None] | None = None, fills: Any = None) -> None: ...

        def _fills(self) -> Any: ...

        def _sync_hyperparameters(self) -> None: ...

    def _side_stream(self, direction: str) -> Any:
        """The context a copy over the link is issued in: ``direction``'s own side stream (none on the CPU)."""
        return self._acc.use_stream(self._streams[direction])

    def _make_hook(self, slot: Slot) -> Callable[[torch.Tensor], None]:
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

    def _land(self, slot: Slot, *, free: bool) -> None:
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
        acc = self._acc
        if d2h is not None:
            self._after_producer(d2h)
        self.link_bytes["device_to_host"] += grad.numel() * grad.element_size()
        with self._side_stream("device_to_host"):
            staged, half = None, None
            if copy and grad.dtype == dst.dtype:
                acc.copy_(dst, grad, stream=d2h)  # straight into the pinned buffer
            elif d2h is None and grad.dtype == dst.dtype:
                dst.add_(grad)  # the "device" is the CPU: adding now costs one pass, staging a copy two
            elif slot.stage is not None and grad.dtype == slot.stage.dtype:
                # Another dtype (bf16 device weights): into the owned pinned stage, the worker casts or adds it.
                if slot.reader is not None:
                    slot.reader.result()  # the last landing's task must have read the stage (long done, in practice)
                acc.copy_(slot.stage, grad, stream=d2h)
                staged = slot.stage
            elif self._sum_numel:
                # A later micro-batch of the window (same dtype): into the sum stage, the worker adds it. Two
                # halves of pinned memory, not a buffer per parameter (4 more bytes each of host RAM).
                staged, half = self._sum_stage_view(slot)
                acc.copy_(staged, grad, stream=d2h)
            else:
                staged = acc.to_host(grad, stream=d2h)  # no streams: a plain copy
            if d2h is not None:
                acc.record_stream(grad, d2h)  # the allocator must not reuse it before the copy is done
        want_norm = self._norms_in_backward or (self._norms_on_first_landing and copy)
        slot.has_grad, slot.zeroed = True, False
        slot.landings += 1
        if free:
            slot.device.grad = None
        self._pending[slot.bucket].append(Landing(slot, dst, staged, copy, want_norm, sum_half=half))
        unlanded = self._unlanded[slot.bucket]
        unlanded.discard(id(slot))
        if not unlanded:
            self._flush_bucket(slot.bucket)
        if self._waiting is not None:
            self._maybe_step_bucket(slot)

    def _sum_stage_view(self, slot: Slot) -> tuple[torch.Tensor, int]:
        """``slot``'s place in the sum stage (allocated by the first call) and its half. A full half hands over to
        the other, once every landing staged there was handed to the landing worker and read."""
        if self._sum_stage is None:
            self._sum_stage, nbytes = own_sum_stage(self._sum_numel, slot.master.dtype, self._acc)
            self.pinned_bytes += nbytes
        stage = self._sum_stage
        place = stage.take(slot.master.numel())
        if place is None:
            stage.current, stage.used = 1 - stage.current, 0
            half = stage.current
            for bucket in sorted(stage.owners[half]):
                if self._pending[bucket]:
                    self._flush_bucket(bucket)  # gradients still staged there: hand them over first
            stage.owners[half].clear()
            if stage.reader[half] is not None:
                # The last landing task reading this half: on the landing worker, behind nothing but landings.
                stage.reader[half].result()
                stage.reader[half] = None
            place = stage.take(slot.master.numel())
        half, offset = place
        stage.owners[half].add(slot.bucket)
        n = slot.master.numel()
        return stage.halves[half][offset:offset + n].view(slot.master.shape), half

    def _after_producer(self, d2h: Any) -> None:
        """Orders the device->host stream after the gradient's producer: autograd's stream for this leaf, the one
        current here (read before entering the side stream's context, which changes the current stream)."""
        self._acc.wait_stream(d2h, self._acc.current_stream())

    def _flush_bucket(self, index: int) -> None:
        """Hands the bucket's pending landings to the worker: one event (the side stream's copies so far) and one
        task that waits for it, adds or casts each staged gradient and takes the norms asked for."""
        landings, self._pending[index] = self._pending[index], []
        self._unlanded[index] = {id(s) for s in self._buckets[index].slots}
        if not landings:
            return
        event = None
        if self._streams["device_to_host"] is not None:
            # After every copy of this bucket: in stream order.
            event = self._acc.record_event(self._streams["device_to_host"])
        # Always a task, even with nothing to add: only the worker writes the slots' norms (in task order).
        task = self._landing_worker.submit(finish_landings, landings, event, self._acc)
        self._landings.append(task)
        for landing in landings:
            if landing.staged is not None and landing.staged is landing.slot.stage:
                landing.slot.reader = task
            if landing.sum_half is not None:
                self._sum_stage.reader[landing.sum_half] = task

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

    def _maybe_step_bucket(self, slot: Slot) -> None:
        if slot.bucket in self._early:
            raise MemtrainError(
                f"the gradient of {slot.key!r} landed twice in one backward after step_in_next_backward() (reentrant "
                "checkpointing runs one backward per block): its bucket was already stepped. To resolve this error, "
                "use non-reentrant checkpointing (memtrain.apply_checkpointing) or do not arm the backward.")
        waiting = self._waiting[slot.bucket]
        waiting.discard(id(slot))
        if not waiting:
            # The step runs on complete gradients: after the bucket's landings, handed over first to the landing
            # worker, whose queue is FIFO (its last task covers every earlier one).
            self._flush_bucket(slot.bucket)
            landed = self._landings[-1] if self._landings else None
            bucket = self._buckets[slot.bucket]
            for s in bucket.slots:
                s.master.grad = s.grads[self._buffer]
            h2d = self._streams["host_to_device"]
            if h2d is not None:
                # The copy back of these weights must not overtake the backward kernels already queued that still
                # read them (this layer's input gradient, issued before its weight's gradient landed): the
                # host-to-device stream waits for everything queued on the compute stream so far.
                self._acc.wait_stream(h2d, self._acc.current_stream())
            self._early[slot.bucket] = self._worker.submit(self._step_bucket, bucket, self._h2d_done, True,
                                                           landed=landed, fills=self._fills())

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


def finish_landings(landings: list[Landing], event: Any, acc: Accelerator) -> None:
    """Worker side of one bucket's gradient copies: wait for the transfers, add (or cast) each staged gradient,
    then take the norms asked for (of the sum, after a parameter's last landing in the list)."""
    acc.synchronize_event(event)  # the copies into the host buffers (and stages) are complete
    last: dict[int, Landing] = {}
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
