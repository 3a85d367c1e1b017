"""CPUOffloadOptimizer's host memory and host weights on the simulated accelerator (issue 28): what it pins is
what its host-RAM check counted, to the byte, and its step never overwrites host weights a streamer's fill may
still be reading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memtrain.optim.offload as offload
from memtrain.device import simulate
from memtrain.device.ledger import next_power_of_two
from memtrain.optim import CPUOffloadOptimizer
from memtrain.optim.host_buffers import aligned, host_buffer_bytes, sum_stage_numel

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def odd_model() -> nn.Module:
    """Parameters of 8,777, 131, 4,847 and 37 elements: no size near a power of two."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(67, 131), nn.Tanh(), nn.Linear(131, 37))


def _train(model: nn.Module, opt: CPUOffloadOptimizer, acc, dtype: torch.dtype, micro: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for _ in range(micro):
            x, y = torch.randn(4, 67, generator=g), torch.randn(4, 37, generator=g)
            with acc.compute():
                nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).float().backward()
        with acc.compute():
            opt.step()
            opt.zero_grad()


def _per_parameter_pinned(params: list[torch.Tensor], widths: list[int]) -> int:
    """What one pinned allocation per parameter and buffer (torch's host allocator) would take."""
    return sum(next_power_of_two(p.numel() * w) for p in params for w in widths)


def test_fp32_weights_pin_exactly_the_checked_buffers_and_stage_sums_in_them(monkeypatch) -> None:
    """fp32 weights, two micro-batches: the masters and the gradient buffer, then the sum stage the second
    micro-batch lands in, are registered slabs: the host ledger's pinned peak is the figure the optimizer checked
    (check_host_ram's buffers, then the stage's), to the byte (no power-of-two rounding), and no gradient goes
    through torch's pinned cache (``to_host``), as the old code's second micro-batch did, unseen by the check."""
    with simulate("64MiB", lag=None) as acc:
        staged_in_cache = []
        monkeypatch.setattr(acc, "to_host", lambda *a, **k: staged_in_cache.append(1))
        model = acc.place(odd_model())
        params = list(model.parameters())
        opt = CPUOffloadOptimizer(model.parameters(), **HYPER)
        buffers = host_buffer_bytes(params, n_grad_buffers=1)
        assert opt.pinned_bytes == buffers, (opt.pinned_bytes, buffers)
        _train(model, opt, acc, torch.float32)
        want = buffers + 2 * 4 * sum_stage_numel([p.numel() for p in params], CPUOffloadOptimizer.bucket_numel)
        peak = acc.host_pinned_bytes()[1]
        assert opt.pinned_bytes == want and peak == want, (
            f"pinned peak {peak} bytes, the optimizer counted {opt.pinned_bytes}, the byte model {want}")
        assert staged_in_cache == [], f"{len(staged_in_cache)} gradients staged through torch's pinned cache"
        assert want < _per_parameter_pinned(params, [4, 4, 4]), "the model must show the rounding it avoids"
        opt.close()


def _per_parameter_stages(slots, acc) -> int:
    """The old way: one pinned allocation per streamed parameter's stage (torch's allocator rounds each up), and
    none of it counted."""
    for slot in slots:
        slot.stage = acc.pinned_empty(slot.cast.shape, slot.cast.dtype)
    return 0


@pytest.mark.parametrize("per_parameter", [False, True], ids=["slab", "per-parameter-fault"])
def test_streamed_bf16_weights_get_their_stages_from_one_exact_slab(per_parameter: bool, monkeypatch) -> None:
    """bf16 device weights handed to parameter offload (stream_weights): their gradient stages are views of one
    slab registered at its exact size, and the pinned peak is the optimizer's figure (check_host_ram's buffers
    plus the stages). With the old per-parameter pinned stages put back, the peak exceeds the figure (Llama-2-13B:
    a 23.6 GiB stage pinned 40 GiB)."""
    if per_parameter:
        monkeypatch.setattr(offload, "own_stages", _per_parameter_stages)
    with simulate("64MiB", lag=None) as acc:
        model = acc.place(odd_model())
        opt = CPUOffloadOptimizer(model.parameters(), device_dtype=torch.bfloat16, **HYPER)
        figure = opt.pinned_bytes
        opt.stream_weights(list(model.parameters()))
        stages = 0 if per_parameter else sum(aligned(p.numel()) * 2 for p in model.parameters())
        assert opt.pinned_bytes == figure + stages, (opt.pinned_bytes, figure, stages)
        assert all(s.stage.data_ptr() != s.cast.data_ptr() for s in opt.slots), "a stage still shares its cast"
        _train(model, opt, acc, torch.bfloat16, micro=1)
        peak = acc.host_pinned_bytes()[1]
        if per_parameter:
            assert peak > opt.pinned_bytes, (peak, opt.pinned_bytes)
        else:
            assert peak == opt.pinned_bytes, f"pinned peak {peak} bytes, the optimizer counted {opt.pinned_bytes}"
        opt.close()


@pytest.mark.parametrize("waits", [True, False], ids=["fills-done", "fault-no-wait"])
def test_the_step_waits_for_the_streamers_last_fill_before_overwriting_host_weights(waits: bool) -> None:
    """A streamer's fill (host weights -> device, on its side stream) issued before step() must read the weights
    before the step: the step waits for the event ``fills_done`` returns before writing the host weights. At the
    unbounded lag the fill runs only when waited: without the wait it reads the new weights."""
    with simulate("64MiB", lag=None) as acc:
        model = acc.place(odd_model())
        opt = CPUOffloadOptimizer(model.parameters(), device_dtype=torch.bfloat16, **HYPER)
        side, pending = acc.new_stream(), []
        hosts = opt.stream_weights(list(model.parameters()))
        opt.wait_for_fills((lambda: pending[-1]) if waits else None)  # as apply_plan, once the streamer exists
        x, y = torch.randn(4, 67), torch.randn(4, 37)
        with acc.compute():
            nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).float().backward()
        before = {k: h.clone() for k, h in hosts.items()}
        filled = {k: acc.empty(h.shape, h.dtype) for k, h in hosts.items()}  # the streamer's device copies
        acc.wait_stream(side, acc.current_stream())
        for k, h in hosts.items():
            acc.copy_(filled[k], h, stream=side)
        pending.append(acc.record_event(side))
        with acc.compute():
            opt.step()
        acc.synchronize_event(pending[-1])
        moved = [k for k in hosts if not torch.equal(hosts[k], before[k])]
        assert moved, "the step must change the host weights for the test to mean anything"
        read_new = [k for k in moved if not torch.equal(filled[k], before[k])]
        if waits:
            assert read_new == [], f"{len(read_new)} fills read host weights the step had already overwritten"
        else:
            assert read_new, "without the wait the fills must read the overwritten weights (the fault is unseen)"
        opt.close()


@pytest.mark.parametrize("waits", [True, False], ids=["wait-for-fills", "fault-no-wait"])
def test_with_the_weight_streamer_a_step_after_an_interrupted_forward_waits_for_its_prefetch(waits: bool) -> None:
    """The real WeightStreamer wired as apply_plan should (``optimizer.wait_for_fills(streamer.fills_done)``): a
    forward interrupted in block 0 (an out-of-memory error) leaves block 1's prefetch queued; the CPU step then
    overwrites block 1's host masters. It waits for the fill first, so block 1's device copy holds the weights the
    fill was issued for; without the wait (unbounded lag) it holds the step's."""
    from memtrain.checkpointing import find_blocks
    from memtrain.offload.weights import WeightStreamer
    from tests.helpers import tiny_gpt

    with simulate("64MiB", lag=None) as acc:
        model = acc.place(tiny_gpt(3, seq_len=8, seed=0))
        opt = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
        blocks = find_blocks(model)
        modules = dict(model.named_modules())
        streamed = [p for name in blocks for p in modules[name].parameters()]
        streamer = WeightStreamer(model, blocks=blocks, prefetch=1, host_weights=opt.stream_weights(streamed))
        if waits:
            opt.wait_for_fills(streamer.fills_done)
        x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        with acc.compute():
            model(x, x).backward()

        def fail(*_: object) -> None:
            raise RuntimeError("out of memory (simulated)")

        handle = model.blocks[0].attn.register_forward_pre_hook(fail)  # inside block 0: block 1 is prefetched
        with pytest.raises(RuntimeError, match="simulated"), acc.compute():
            model(x, x)
        handle.remove()
        weights = streamer.blocks[1].weights
        with acc.host():
            before = [w.host.clone() for w in weights]
        with acc.compute():
            opt.step()
        with torch.no_grad():
            acc.synchronize()
        assert any(not torch.equal(w.host, b) for w, b in zip(weights, before, strict=True)), "the step moved nothing"
        differ = [i for i, (w, b) in enumerate(zip(weights, before, strict=True)) if not torch.equal(w.device, b)]
        if waits:
            assert not differ, f"block 1's weights {differ} on the device are the step's, not the fill's"
        else:
            assert differ, "without the wait the fill must read the stepped weights (the fault is unseen)"
        streamer.close()
        opt.close()
