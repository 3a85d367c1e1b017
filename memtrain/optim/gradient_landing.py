"""The backward half of CPUOffloadOptimizer: gradients stream device -> host as autograd produces them.

CPUOffloadOptimizer's post-accumulate-grad hook hands each gradient to its ``GradientLanding``, which copies it to a
host buffer on the device->host side stream and frees it on the device; the host side of the landings (waiting for
the copies, adding, casting, taking norms) goes to the landing thread once per bucket. Armed by
``step_in_next_backward``, it reports each bucket whose last gradient landed, and the offloader's ``HostStepper``
steps it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from memtrain.device import Accelerator
from memtrain.errors import MemtrainError
from memtrain.optim.host_buffers import Bucket, Landing, Link, Slot, SumStage, own_sum_stage


class GradientLanding:
    """The landings of one CPUOffloadOptimizer: which host buffer the next backward writes, the landings not yet
    handed to the landing worker, the tasks in flight, the norms asked for, the sum stage and the buckets armed to
    step in backward. The offloader builds it over its slots and buckets and calls ``land`` from its hooks.

    Args:
        slots: the offloader's slots, in param_groups order.
        buckets: its buckets (each slot's ``bucket`` indexes them).
        link: the offloader's link to the host (``host_buffers.Link``, shared with its stepper): the gradients go
            down on its device -> host side stream and add to its byte counters.
        sum_numel: elements of each half of the sum stage (0: none, later micro-batches stage by other means).
    """

    def __init__(self, slots: list[Slot], buckets: list[Bucket], *, link: Link, sum_numel: int):
        self.slots, self.buckets = slots, buckets
        self.link = link
        self.acc, self.streams, self.link_bytes = link.acc, link.streams, link.bytes  # the link's, for short
        # The host side of the landings runs on a thread of its own: a delayed step (seconds of CPU work) on the
        # step's thread must not hold the next backward's landings, which a second micro-batch waits for before
        # reusing a gradient stage. Tasks that need the landings done wait for them explicitly.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtrain-cpu-optim-landing")
        self.tasks: list[Future[None]] = []
        # Per bucket: this backward's landings not yet handed to the worker, and the slots not landed yet. A
        # bucket's landings go to the worker in one task once all its slots landed (or at clip/step time).
        self.pending: list[list[Landing]] = [[] for _ in buckets]
        self.unlanded: list[set[int]] = [{id(s) for s in b.slots} for b in buckets]
        self.buffer = 0  # which host gradient buffer the next backward writes
        # next_backward_is_last(): the worker takes each gradient's norm as it lands in the next backward.
        self.norms_in_backward = False
        # Set by a clip_grad_norm_ after a window of one backward: the worker then takes the norm of each gradient
        # landing first in its window (a loop with one backward per step needs no call to get them).
        self.norms_on_first_landing = False
        # step_in_next_backward(): the buckets whose gradients have not all landed yet, and the steps started.
        self.waiting: list[set[int]] | None = None
        self.early: dict[int, Future[None]] = {}
        # Where a later micro-batch's gradient lands before it is added: allocated by the first one, so that a run
        # without accumulation pins none.
        self.sum_numel = sum_numel
        self.sum_stage: SumStage | None = None
        self.pinned_bytes = 0  # the sum stage's, once allocated

    def land(self, slot: Slot, *, free: bool) -> int | None:
        """Copies ``slot``'s device gradient into its host buffer (added when one is already there).

        Returns:
            The index of a bucket armed by ``arm()`` whose gradients have now all landed (its masters' ``.grad``
            attached): the caller starts its step. None otherwise.
        """
        grad = slot.device.grad
        if grad is None:
            return None
        dst = slot.grads[self.buffer]
        # Without offload_gradients the device gradient already holds the micro-batches' sum: copy, never add.
        copy = not slot.has_grad or slot.zeroed or not free
        if id(slot) not in self.unlanded[slot.bucket]:
            # Landed again before its bucket completed (a new backward, or a parameter that got no gradient in
            # the last one): hand over what is pending first, so that a bucket never holds two backwards' copies.
            self.flush_bucket(slot.bucket)
        d2h = self.streams["device_to_host"]
        acc = self.acc
        if d2h is not None:
            self._after_producer(d2h)
        self.link_bytes["device_to_host"] += grad.numel() * grad.element_size()
        with self.link.side_stream("device_to_host"):
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
            elif self.sum_numel:
                # A later micro-batch of the window (same dtype): into the sum stage, the worker adds it. Two
                # halves of pinned memory, not a buffer per parameter (4 more bytes each of host RAM).
                staged, half = self._sum_stage_view(slot)
                acc.copy_(staged, grad, stream=d2h)
            else:
                staged = acc.to_host(grad, stream=d2h)  # no streams: a plain copy
            if d2h is not None:
                acc.record_stream(grad, d2h)  # the allocator must not reuse it before the copy is done
        want_norm = self.norms_in_backward or (self.norms_on_first_landing and copy)
        slot.has_grad, slot.zeroed = True, False
        slot.landings += 1
        if free:
            slot.device.grad = None
        self.pending[slot.bucket].append(Landing(slot, dst, staged, copy, want_norm, sum_half=half))
        unlanded = self.unlanded[slot.bucket]
        unlanded.discard(id(slot))
        if not unlanded:
            self.flush_bucket(slot.bucket)
        return self._complete_bucket(slot) if self.waiting is not None else None

    def _sum_stage_view(self, slot: Slot) -> tuple[torch.Tensor, int]:
        """``slot``'s place in the sum stage (allocated by the first call) and its half. A full half hands over to
        the other, once every landing staged there was handed to the landing worker and read."""
        if self.sum_stage is None:
            self.sum_stage, self.pinned_bytes = own_sum_stage(self.sum_numel, slot.master.dtype, self.acc)
        stage = self.sum_stage
        place = stage.take(slot.master.numel())
        if place is None:
            stage.current, stage.used = 1 - stage.current, 0
            half = stage.current
            for bucket in sorted(stage.owners[half]):
                if self.pending[bucket]:
                    self.flush_bucket(bucket)  # gradients still staged there: hand them over first
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
        self.acc.wait_stream(d2h, self.acc.current_stream())

    def flush_bucket(self, index: int) -> None:
        """Hands the bucket's pending landings to the worker: one event (the side stream's copies so far) and one
        task that waits for it, adds or casts each staged gradient and takes the norms asked for."""
        landings, self.pending[index] = self.pending[index], []
        self.unlanded[index] = {id(s) for s in self.buckets[index].slots}
        if not landings:
            return
        event = None
        if self.streams["device_to_host"] is not None:
            # After every copy of this bucket: in stream order.
            event = self.acc.record_event(self.streams["device_to_host"])
        # Always a task, even with nothing to add: only the worker writes the slots' norms (in task order).
        task = self.worker.submit(finish_landings, landings, event, self.acc)
        self.tasks.append(task)
        for landing in landings:
            if landing.staged is not None and landing.staged is landing.slot.stage:
                landing.slot.reader = task
            if landing.sum_half is not None:
                self.sum_stage.reader[landing.sum_half] = task

    def flush(self) -> None:
        """Hands every bucket's pending landings to the worker (buckets holding a parameter with no gradient)."""
        for index in range(len(self.buckets)):
            self.flush_bucket(index)

    def wait(self) -> None:
        """Flushes, then waits for every landing task (re-raising a worker error here)."""
        self.flush()
        for task in self.tasks:
            task.result()
        self.tasks.clear()
        self.norms_in_backward = False

    def _complete_bucket(self, slot: Slot) -> int | None:
        """An armed backward: ``slot`` landed; its bucket's index once all of the bucket's gradients have."""
        if slot.bucket in self.early:
            raise MemtrainError(
                f"the gradient of {slot.key!r} landed twice in one backward after step_in_next_backward() (reentrant "
                "checkpointing runs one backward per block): its bucket was already stepped. To resolve this error, "
                "use non-reentrant checkpointing (memtrain.apply_checkpointing) or do not arm the backward.")
        waiting = self.waiting[slot.bucket]
        waiting.discard(id(slot))
        if waiting:
            return None
        # The step runs on complete gradients: after the bucket's landings, handed over first to the landing
        # worker, whose queue is FIFO (its last task covers every earlier one).
        self.flush_bucket(slot.bucket)
        for s in self.buckets[slot.bucket].slots:
            s.master.grad = s.grads[self.buffer]
        return slot.bucket

    def last_task(self) -> Future[None] | None:
        """The landing worker's last task: done, every landing handed over so far is complete."""
        return self.tasks[-1] if self.tasks else None

    def arm(self) -> None:
        """Arms the next backward: each bucket is reported by ``land`` once its last gradient lands."""
        self.waiting = [{id(s) for s in b.slots} for b in self.buckets]

    def disarm(self) -> dict[int, Future[None]]:
        """Ends an armed backward: the steps it started, by bucket index."""
        early, self.early, self.waiting = self.early, {}, None
        return early


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
