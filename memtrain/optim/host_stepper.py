"""The step half of CPUOffloadOptimizer: the wrapped optimizer steps the fp32 masters bucket by bucket on a worker
thread, and each bucket's new weights go back host -> device on a side stream while the next bucket steps.

CPUOffloadOptimizer builds one ``HostStepper`` over its slots and buckets (``host_buffers.make_buckets``) and hands
it, at each step, what only it knows then: the hyper-parameters of its ``param_groups``, the multiplier and inf flag
of its host gradients, the buckets already stepped in backward. The stepper owns the worker thread, the delayed
update in flight, the event after the last copies back and parameter offload's fills of the host weights it
overwrites.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from memtrain.optim.host_buffers import Bucket, Link, Slot, hyperparameters


class HostStepper:
    """The host step of one CPUOffloadOptimizer: its buckets stepped on a worker thread and copied back to the
    device on the host -> device side stream, at once or (``delayed``) during the next forward and backward.

    Args:
        slots: the offloader's slots, in param_groups order.
        buckets: its buckets (``host_buffers.make_buckets``), stepped in this order.
        link: the offloader's link to the host (``host_buffers.Link``, shared with its landings): the copies back
            run on its host -> device side stream and add to its byte counters.
        delayed: the offloader's ``delayed_update``: ``run`` starts the CPU step and returns; ``finish_update``
            (the next gather, ``synchronize``) waits for it and copies the weights back.

    Example:
        >>> stepper = HostStepper(slots, buckets, link=Link(acc, streams=acc.has_streams), delayed=False)
        >>> stepper.sync_hyperparameters(optimizer.param_groups)
        >>> stepper.run(1.0, None, early={})  # every bucket stepped, its weights on their way to the device
    """

    def __init__(self, slots: list[Slot], buckets: list[Bucket], *, link: Link, delayed: bool):
        self.slots, self.buckets = slots, buckets
        self.link = link
        self.acc, self.streams, self.link_bytes = link.acc, link.streams, link.bytes  # the link's, for short
        self.delayed = delayed
        # One thread steps the buckets in order: the fused CPU kernel already uses every core, and the copies back
        # are issued from it as each bucket finishes.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtrain-cpu-optim")
        self.streamed: set[int] = set()  # id(slot) of the parameters whose weights parameter offload streams
        # Parameter offload's fills of the host weights the step overwrites (stream_weights): an event after them.
        self.fills_done: Callable[[], Any] | None = None
        self.in_flight: list[Future[None]] | None = None  # the CPU step in flight (delayed)
        self.h2d_done: Any = None  # the event after the last copies back

    def sync_hyperparameters(self, param_groups: list[dict[str, Any]]) -> None:
        """Copies the outer ``param_groups``' hyper-parameters (an LR scheduler's writes) into the host optimizers,
        before they step."""
        for bucket in self.buckets:
            for inner_group, gi in zip(bucket.inner.param_groups, bucket.group_of, strict=True):
                inner_group.update(hyperparameters(param_groups[gi]))

    def fills_event(self) -> Any:
        """The event after parameter offload's fills issued so far (``fills_done``), or None."""
        return self.fills_done() if self.fills_done is not None else None

    def run(self, multiplier: float | torch.Tensor, found: torch.Tensor | None, *,
            early: dict[int, Future[None]]) -> None:
        """Steps every bucket not in ``early`` (stepped in backward, by index) on the worker with the host
        gradients times ``multiplier``, skipping all on a non-zero ``found``; then waits for them and queues the
        next forward behind the copies back, or (``delayed``) leaves them in flight for ``finish_update``."""
        if self.streams["host_to_device"] is not None:
            # The copies back overwrite weights that this step's backward read on the compute stream.
            self.acc.wait_stream(self.streams["host_to_device"], self.acc.current_stream())
        h2d_done, fills = self.h2d_done, self.fills_event()
        futures = list(early.values())  # stepped during backward (step_in_next_backward)
        futures += [self.worker.submit(self.step_bucket, b, h2d_done, not self.delayed, multiplier, found,
                                       fills=fills)
                    for i, b in enumerate(self.buckets) if i not in early]
        if self.delayed:
            self.in_flight = futures
            return
        for future in futures:
            future.result()
        self.after_copies()

    def step_early(self, index: int, landed: Future[None] | None) -> Future[None]:
        """step_in_next_backward: bucket ``index``'s gradients all landed; its step starts on the worker, behind
        ``landed`` (the landing task that completes them). Returns the step's future."""
        h2d = self.streams["host_to_device"]
        if h2d is not None:
            # The copy back of these weights must not overtake the backward kernels already queued that still
            # read them (this layer's input gradient, issued before its weight's gradient landed): the
            # host-to-device stream waits for everything queued on the compute stream so far.
            self.acc.wait_stream(h2d, self.acc.current_stream())
        return self.worker.submit(self.step_bucket, self.buckets[index], self.h2d_done, True, landed=landed,
                                  fills=self.fills_event())

    def step_bucket(self, bucket: Bucket, h2d_done: Any, copy_back: bool,
                    multiplier: float | torch.Tensor = 1.0, found: torch.Tensor | None = None, *,
                    landed: Future[None] | None = None, fills: Any = None) -> None:
        """On the worker: steps ``bucket``'s masters (gradients times ``multiplier``; nothing on a non-zero
        ``found``), casts them to the device dtype and, with ``copy_back``, launches their copies to the device.
        Waits first for ``landed``, for the last copies back (``h2d_done``) and for parameter offload's ``fills``,
        which read what it overwrites."""
        if landed is not None:
            landed.result()  # step_in_next_backward: the bucket's landings (on the landing worker) are complete
        if found is not None and found.item():
            return  # an inf/nan gradient (fp16 overflow): skipped, weights and state untouched, nothing to copy
        with torch.no_grad():
            # The previous copies back, and parameter offload's fills, read the masters (and casts) we are about
            # to overwrite.
            self.acc.synchronize_event(h2d_done)
            self.acc.synchronize_event(fills)
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
            # Cast on the CPU, here on the worker: the device dtype's bytes cross PCIe, and with a delayed update
            # the loop's thread then only launches the copies at the next step().
            for slot in bucket.slots:
                if slot.cast is not None:
                    slot.cast.copy_(slot.master)
            if copy_back:
                self.copy_to_device(bucket.slots)

    def copy_to_device(self, slots: list[Slot]) -> None:
        """Launches the copies of the (already cast) new weights into the device parameters, on the side stream;
        parameter offload's (``streamed``) stay on the host."""
        slots = [s for s in slots if id(s) not in self.streamed]  # parameter offload reads them from the host
        if not slots:
            return
        self.link_bytes["host_to_device"] += sum(s.device.numel() * s.device.element_size() for s in slots)
        with torch.no_grad(), self.link.side_stream("host_to_device"):
            # One call for the lot: a per-tensor Python loop costs several microseconds a tensor on the loop's thread.
            self.acc.foreach_copy_([s.device for s in slots], [s.master if s.cast is None else s.cast for s in slots],
                                   stream=self.streams["host_to_device"])

    def after_copies(self) -> None:
        """Orders the next forward (the compute stream) after the copies back issued so far."""
        h2d = self.streams["host_to_device"]
        if h2d is not None:
            self.h2d_done = self.acc.record_event(h2d)
            # The next forward reads the new weights: order it after the copies (the device waits, not the host).
            self.acc.wait_event(self.h2d_done, self.acc.current_stream())

    @torch.no_grad()
    def finish_update(self) -> None:
        """A delayed update: waits for its CPU step and copies its weights to the device (no-op when none is in
        flight)."""
        if self.in_flight is None:
            return
        for future in self.in_flight:
            future.result()
        self.in_flight = None
        if self.streams["host_to_device"] is not None:
            # The next backward read the old weights on the compute stream: the copies back wait for it (not for
            # the gradient copies, on the other side stream).
            self.acc.wait_stream(self.streams["host_to_device"], self.acc.current_stream())
        self.copy_to_device(self.slots)
        self.after_copies()
