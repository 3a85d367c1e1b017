"""CPUOffloadOptimizer's worker threads: what must never wait for what (issue 28).

The delayed CPU step runs during the next window's forward and backward; the gradients of that window land on a
thread of their own, so that a second micro-batch's landing never queues behind the whole step.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

import pytest
import torch
from test_optim_offload import HYPER, batches, loss_fn, make_mlp

from memtrain.device import simulate
from memtrain.optim import CPUOffloadOptimizer


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated-lag-none"])
def test_a_landing_never_waits_for_the_delayed_step(simulated: bool, monkeypatch) -> None:
    """bf16 device weights, delayed update, two micro-batches: the second micro-batch's gradients land in the
    stages the first one's landings read, which the old code ran on the step's single worker thread, queued behind
    the delayed step (measured: backward of micro-batch 2 took the whole 1.0 s emulated step). The emulated step here
    holds until the test releases it after the window's second backward: on the old code that backward waits for the
    step, and the step only goes on after its 3 s timeout (``released`` stays False). On the plain CPU and on the
    simulated device (side streams and events, the landings waiting for their copies)."""
    with simulate("64MiB", lag=None) if simulated else nullcontext() as acc:
        model = make_mlp().to(torch.bfloat16)
        _delayed_window(acc.place(model) if simulated else model, monkeypatch)


def _delayed_window(model, monkeypatch) -> None:
    opt = CPUOffloadOptimizer(model.named_parameters(), delayed_update=True, **HYPER)
    gate, released = threading.Event(), []
    for bucket in opt._buckets:
        inner_step = bucket.inner.step

        def held_step(*args, _step=inner_step, **kwargs):
            released.append(gate.wait(timeout=3.0))  # stands in for a long CPU step
            return _step(*args, **kwargs)

        monkeypatch.setattr(bucket.inner, "step", held_step)
    data = batches(4)
    for x, y in data[:2]:  # the first window: no step in flight yet
        (loss_fn(model, x.bfloat16(), y.bfloat16()) / 2).backward()
    opt.step()  # returns at once: the CPU step runs during the next window, held until the gate opens
    opt.zero_grad()
    for x, y in data[2:]:
        (loss_fn(model, x.bfloat16(), y.bfloat16()) / 2).backward()
    gate.set()  # both backwards of the window are done: the delayed step may finish now
    opt.synchronize()
    assert released and all(released), (
        f"{len(released) - sum(released)} of {len(released)} bucket steps timed out before the test released them: "
        "the window's second backward waited for the delayed step")
    opt.close()
