"""Activation offload (offload_activations) on the simulated accelerator: its side stream, events, pinned pool and
device ledger run, at stream lags 0, 1, 3 and unbounded. Gradients equal plain training's bit for bit, the device
holds at least half the offloaded bytes less than plain training (the other half covers the copies in flight both
ways), and each fault re-introduced below fails these checks.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torch import nn

from memtrain.device import Accelerator, simulate
from memtrain.offload import ActivationOffloader, Transport, offload_activations
from tests.helpers import tiny_gpt

LAGS = [0, 1, 3, None]
CAPACITY = "64MiB"
MIN_BYTES = 4096  # the activations of the tiny GPT (32 KiB and up) move; biases, norms' statistics stay


def _model() -> nn.Module:
    return tiny_gpt(2, n_embd=64, seq_len=32, seed=0)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module, x: torch.Tensor, acc: Accelerator, context: ActivationOffloader | None = None
           ) -> dict[str, torch.Tensor]:
    with acc.compute():
        if context is None:
            loss = model(x, x)
        else:
            with context:
                loss = model(x, x)
        loss.backward()
    with acc.host():
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _measured(acc: Accelerator, step) -> tuple[dict[str, torch.Tensor], int]:
    """``step()``'s gradients and the peak device bytes it reserved beyond what was allocated before it."""
    gc.collect()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    grads = step()
    return grads, acc.max_memory_reserved() - before


@functools.cache
def _plain() -> tuple[dict[str, torch.Tensor], int]:
    with simulate(CAPACITY, lag=0) as acc:
        model = _model()
        acc.place(model)
        x = acc.place(_tokens())
        return _measured(acc, lambda: _grads(model, x, acc))


def check_offloader(lag: int | None) -> None:
    """The simulated check of activation offload (raises AssertionError with the numbers)."""
    expected, plain_peak = _plain()
    with simulate(CAPACITY, lag=lag) as acc:
        model = _model()
        acc.place(model)
        x = acc.place(_tokens())
        off = offload_activations(model=model, min_bytes=MIN_BYTES, host_budget_bytes=2**22)
        assert off.enabled, "the simulated device has streams: offload must be on"
        for step in range(2):  # the second reuses the pool and the recorded backward order
            moved = off.stats().offloaded_bytes
            got, peak = _measured(acc, lambda: _grads(model, x, acc, off))
            moved = off.stats().offloaded_bytes - moved
            differ = {n: (got[n] - expected[n]).abs().max().item() for n in expected
                      if not torch.equal(got[n], expected[n])}
            # Bit-identical: the saved tensors only travel (tolerance 0).
            assert not differ, f"lag {lag}, step {step}: gradients differ (max abs diff per tensor): {differ}"
            bound = plain_peak - moved // 2
            assert moved > 0 and peak <= bound, (f"lag {lag}, step {step}: peak reserved {peak} bytes > {bound} "
                                                 f"(plain training's {plain_peak} less half the {moved} offloaded)")
        pinned = acc.host_pinned_bytes()[1]
        assert pinned == off.stats().host_reserved_bytes, f"{pinned} bytes pinned for the pool's {off.stats()}"


@pytest.mark.parametrize("lag", LAGS, ids=[f"lag{lag}" for lag in LAGS])
def test_offloaded_activations_give_plain_gradients_and_save_device_bytes(lag):
    check_offloader(lag)


# -- faults: each re-introduced, the check above must fail ------------------------------------------------------
def _copy_allocated_on_the_side_stream(self: Transport, segments, nbytes: int, tag: int):
    """The transport before the fix: the restored tensor allocated on the side stream."""
    dst = self.acc.empty(nbytes, torch.uint8, stream=self.stream)
    for offset, host in segments:
        self.acc.copy_(dst[offset:offset + host.numel()], host, stream=self.stream)
    return dst, self.acc.record_event(self.stream)


def _wait_and_record_stream(self: ActivationOffloader, record) -> None:
    if record.h2d_event is not None:
        self.transport.wait(record.h2d_event)
        self.transport.acc.record_stream(record.data, self.transport.acc.current_stream())
        record.h2d_event = None


def _no_wait(self: ActivationOffloader, record) -> None:
    record.h2d_event = None  # backward reads the restored tensor while its copy may still be queued


FAULTS = {
    # fault -> (patches, the lags at which the check catches it)
    "restored tensors read without waiting for their copy": ({(ActivationOffloader, "_wait_data"): _no_wait},
                                                             {1, 3, None}),
    "side-stream allocation with record_stream": (
        {(Transport, "copy_to_device"): _copy_allocated_on_the_side_stream,
         (ActivationOffloader, "_wait_data"): _wait_and_record_stream}, {None}),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_fails_the_simulated_check(monkeypatch, fault):
    """At lag 0 the side stream runs each copy at once; a block held by a recorded use is freed as soon as the
    compute stream passes it, which only an unbounded lag delays past the next allocations."""
    patches, expected = FAULTS[fault]
    for (target, name), fn in patches.items():
        monkeypatch.setattr(target, name, fn)
    caught = set()
    for lag in LAGS:
        try:
            check_offloader(lag)
        except AssertionError:
            caught.add(lag)
    assert caught == expected, f"{fault}: caught at lags {sorted(caught, key=str)}, expected {sorted(expected, key=str)}"
