"""Parameter offload (WeightStreamer) on the simulated accelerator: its side stream, events and memory ledger run, at
stream lags 0, 1, 3 and unbounded. Gradients equal plain training's bit for bit (the copies move bytes; nothing is
computed differently), the device holds at most ``1 + prefetch`` blocks' weights beyond the rest of the step, the
host copies are one exact-size pinned slab, and each fault re-introduced below fails these checks.

The activation offloader and the device prefetcher on the simulator: tests/test_offload_simulated_activations.py.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import memtrain.offload.weights as weights_mod
from memtrain.checkpointing import apply_checkpointing, find_blocks
from memtrain.device import Accelerator, simulate
from memtrain.device.ledger import BLOCK, round_up
from memtrain.offload.weights import WeightStreamer
from tests.helpers import tiny_gpt

LAGS = [0, 1, 3, None]
CAPACITY = "64MiB"
MICRO_BATCHES = 2


def _model(checkpointing: bool) -> nn.Module:
    model = tiny_gpt(3, seq_len=8, seed=0)
    if checkpointing:
        apply_checkpointing(model)  # the recompute in backward needs the block's weights again
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module, x: torch.Tensor, acc: Accelerator) -> dict[str, torch.Tensor]:
    """Two micro-batches' accumulated gradients, cloned to the host (not counted as device memory)."""
    with acc.compute():
        for _ in range(MICRO_BATCHES):
            model(x, x).backward()
    with acc.host():
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _block_bytes(model: nn.Module) -> list[int]:
    """Each block's weights as the device ledger counts them (every storage rounded to the allocator's block)."""
    modules = dict(model.named_modules())
    return [sum(round_up(p.numel() * p.element_size(), BLOCK) for p in modules[n].parameters())
            for n in find_blocks(model)]


@functools.cache
def _plain(checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Plain training's gradients and its peak device bytes over the step (no streams: any lag gives the same)."""
    with simulate(CAPACITY, lag=0) as acc:
        model = _model(checkpointing)
        acc.place(model)
        x = acc.place(_tokens())
        gc.collect()
        acc.reset_peak_memory_stats()
        grads = _grads(model, x, acc)
        return grads, acc.max_memory_reserved()


@dataclass
class Streamed:
    grads: dict[str, torch.Tensor]
    peak_reserved: int
    retries: int
    pinned_peak: int
    block_bytes: list[int]
    own_host_bytes: int  # the streamer's own host copies, exactly


def _streamed(lag: int | None, checkpointing: bool, prefetch: int) -> Streamed:
    with simulate(CAPACITY, lag=lag) as acc:
        model = _model(checkpointing)
        # apply_plan's placement: everything but the streamed blocks' weights, which never are whole on the device.
        streamed = {id(p) for b in model.blocks for p in b.parameters()}
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in streamed:
                acc.place(t)
        x = acc.place(_tokens())
        streamer = WeightStreamer(model, blocks=find_blocks(model), prefetch=prefetch)
        unseen = [w.nbytes for b in streamer.blocks for w in b.weights if not acc.ledger.is_device(w.device)]
        assert not unseen, f"{len(unseen)} device tensors ({sum(unseen)} bytes) are not device memory on the ledger"
        gc.collect()
        acc.reset_peak_memory_stats()
        grads = _grads(model, x, acc)
        assert streamer.stats.resident_blocks == 0, "blocks left on the device after backward"
        own = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
        return Streamed(grads, acc.max_memory_reserved(), acc.memory_stats()["num_alloc_retries"],
                        acc.host_pinned_bytes()[1], _block_bytes(model), own)


def check_streamer(lag: int | None, checkpointing: bool, prefetch: int) -> None:
    """The simulated check of WeightStreamer (raises AssertionError with the numbers)."""
    expected, plain_peak = _plain(checkpointing)
    got = _streamed(lag, checkpointing, prefetch)
    # Bit-identical: the streamer only moves bytes (tolerance 0).
    differ = {n: (got.grads[n] - expected[n]).abs().max().item() for n in expected
              if not torch.equal(got.grads[n], expected[n])}
    assert not differ, f"lag {lag}: gradients differ from plain training's (max abs diff per tensor): {differ}"
    # The rest of the step (non-block weights, activations, gradients) is plain training's peak less every block's
    # weights; beyond it the device holds at most the blocks in flight. Reserved: a block freed with a use recorded
    # on another stream and not yet passed counts too.
    sizes, peak = got.block_bytes, got.peak_reserved
    bound = plain_peak - sum(sizes) + min(1 + prefetch, len(sizes)) * max(sizes)
    assert peak <= bound, (f"lag {lag}: peak reserved {peak} bytes > {bound} (plain training's {plain_peak} less "
                           f"the blocks {sizes} plus {1 + prefetch} in flight)")
    assert got.retries == 0, f"lag {lag}: {got.retries} allocation retries (full synchronisations)"
    # One exact-size slab for the streamer's own host copies: no power-of-two rounding per parameter.
    pinned, exact = got.pinned_peak, got.own_host_bytes
    assert pinned == exact, f"lag {lag}: {pinned} pinned host bytes for {exact} bytes of host weights"


@pytest.mark.parametrize("lag", LAGS, ids=[f"lag{lag}" for lag in LAGS])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_streamer_equals_plain_training_within_its_blocks_in_flight(lag, checkpointing, prefetch):
    check_streamer(lag, checkpointing, prefetch)


def check_fills_done(lag: int | None) -> None:
    """A forward interrupted in block 0 (an out-of-memory error) leaves block 1's copies queued, waited by nobody:
    the optimizer's CPU step then overwrites the host weights they read. Waiting for the event ``fills_done()``
    returns before the step, the device holds the weights the fill was issued for."""
    with simulate(CAPACITY, lag=lag) as acc:
        model = _model(checkpointing=False)
        acc.place(model)
        streamer = WeightStreamer(model, blocks=find_blocks(model), prefetch=1)

        def fail(*_: object) -> None:
            raise RuntimeError("out of memory (simulated)")

        model.blocks[0].attn.register_forward_pre_hook(fail)  # inside block 0: block 1 is prefetched already
        with pytest.raises(RuntimeError, match="simulated"), acc.compute():
            model(acc.place(_tokens()))
        weights = streamer.blocks[1].weights
        with acc.host():
            before = [w.host.clone() for w in weights]
        acc.synchronize_event(streamer.fills_done())  # what the optimizer's step does first
        with torch.no_grad():
            for w in weights:
                w.host.add_(1.0)  # the CPU step, in place in the host weights the next forward streams
        acc.synchronize()
        differ = [i for i, (w, b) in enumerate(zip(weights, before, strict=True)) if not torch.equal(w.device, b)]
        assert not differ, f"lag {lag}: block 1's weights {differ} on the device are the step's, not the fill's"


@pytest.mark.parametrize("lag", LAGS, ids=[f"lag{lag}" for lag in LAGS])
def test_fills_done_orders_the_cpu_step_after_the_copies_reading_the_host_weights(lag):
    check_fills_done(lag)


# -- faults: each re-introduced, the check above must fail ------------------------------------------------------
def _use_without_waiting(self: WeightStreamer, block) -> None:
    self._fill(block)  # the compute stream reads the block's weights while their copies may still be queued


def _fill_on_the_side_stream(self: WeightStreamer, block) -> None:
    """The streamer before the fix: storage allocated on the side stream, handed to compute by record_stream."""
    if block.resident:
        return
    acc = self.acc
    with acc.use_stream(self.stream):
        for w in block.weights:
            acc.resize_storage(w.device, w.nbytes)
    acc.foreach_copy_([w.device for w in block.weights], [w.host for w in block.weights], stream=self.stream)
    block.event = self._last_fill = acc.record_event(self.stream)
    for w in block.weights:
        w.param.data = w.device
    block.resident = True
    self.stats.resident_blocks += 1


def _use_with_record_stream(self: WeightStreamer, block) -> None:
    self._fill(block)
    if block.event is not None:
        self.acc.wait_event(block.event)
        for w in block.weights:
            self.acc.record_stream(w.device, self.acc.current_stream())
        block.event = None


def _pinned_per_parameter(params, given, acc):
    """The host copies before the fix: one pinned allocation per parameter (each rounded up to a power of two)."""
    hosts = dict(given)
    for p in params:
        if id(p) not in hosts:
            hosts[id(p)] = acc.pinned_empty(tuple(p.shape), p.dtype)
            hosts[id(p)].copy_(p.detach())
    return hosts, torch.empty(0, dtype=torch.uint8)


FAULTS = {
    # fault -> (patches, the lags at which the check catches it)
    "use without waiting for the fill": ({"_use": _use_without_waiting}, {1, 3, None}),
    "side-stream allocation with record_stream": (
        {"_fill": _fill_on_the_side_stream, "_use": _use_with_record_stream}, {None}),
    "a pinned allocation per parameter": ({"_host_copies": _pinned_per_parameter}, {0, 1, 3, None}),
}


def test_a_cpu_step_without_fills_done_is_caught(monkeypatch):
    monkeypatch.setattr(WeightStreamer, "fills_done", lambda self: None)  # "no fill in flight": nothing waited
    caught = set()
    for lag in LAGS:
        try:
            check_fills_done(lag)
        except AssertionError:
            caught.add(lag)
    assert caught == {1, 3, None}, f"caught at lags {sorted(caught, key=str)}"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_fails_the_simulated_check(monkeypatch, fault):
    """At lag 0 the side stream runs each copy at once, so a missing wait cannot show; a block held by a recorded
    use is freed as soon as the compute stream passes it, which only an unbounded lag delays past the next fills."""
    patches, expected = FAULTS[fault]
    for name, fn in patches.items():
        target = weights_mod if name == "_host_copies" else WeightStreamer
        monkeypatch.setattr(target, name, fn)
    caught = set()
    for lag in LAGS:
        try:
            check_streamer(lag, checkpointing=False, prefetch=1)
        except AssertionError:
            caught.add(lag)
    assert caught == expected, f"{fault}: caught at lags {sorted(caught, key=str)}, expected {sorted(expected, key=str)}"
