"""Parameter offload (WeightStreamer): the same gradients and parameters as plain training, then the device bytes.

On this CPU-only machine the "device" is the CPU: the hooks, the storages resized to zero and back, the host copies
and the counters are the code a GPU runs, without the side stream.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memtrain.accumulation import GradientAccumulator
from memtrain.checkpointing import apply_checkpointing, find_blocks
from memtrain.errors import ConfigError
from memtrain.offload.weights import WeightStreamer
from memtrain.optim import CPUOffloadOptimizer
from tests.helpers import tiny_gpt, tiny_llama_config

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "wte"):  # the built-in GPT
        return model(x, x)
    return model(input_ids=x, labels=x).loss


def _gpt() -> nn.Module:
    return tiny_gpt(4, seed=0)


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3))


def _tokens(model: nn.Module) -> torch.Tensor:
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


def _block_bytes(model: nn.Module) -> list[int]:
    modules = dict(model.named_modules())
    return [sum(p.numel() * p.element_size() for p in modules[n].parameters()) for n in find_blocks(model)]


def _grads(model: nn.Module, x: torch.Tensor, micro_batches: int) -> dict[str, torch.Tensor]:
    for _ in range(micro_batches):
        _loss(model, x).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [_gpt, _llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gradients_equal_plain_training_and_the_device_holds_the_blocks_in_flight(build, checkpointing, prefetch):
    model = build()
    x = _tokens(model)
    expected = _grads(copy.deepcopy(model), x, micro_batches=2)
    if checkpointing:
        apply_checkpointing(model)  # the recompute in backward needs the block's weights again
    streamer = WeightStreamer(model, blocks=find_blocks(model), prefetch=prefetch)
    got = _grads(model, x, micro_batches=2)
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    assert worst <= 1e-6, f"max abs gradient difference {worst:.3g}"
    sizes = _block_bytes(model)
    in_flight = min(1 + prefetch, len(sizes))
    stats = streamer.stats
    assert stats.peak_resident_blocks == in_flight, stats
    assert stats.peak_resident_bytes <= in_flight * max(sizes), stats
    assert stats.resident_bytes == 0 and stats.resident_blocks == 0, "blocks left on the device after backward"
    # Every block crosses the link twice per micro-batch (forward, backward), the recompute included in the second.
    assert stats.link_bytes["host_to_device"] == 2 * 2 * sum(sizes), stats


def test_the_blocks_really_leave_the_device_between_uses():
    """Counted independently of the streamer's own counters: at each block's forward, how many blocks' parameters
    read a device tensor with storage (not their host copy)."""
    model = _gpt()
    streamer = WeightStreamer(model, blocks=find_blocks(model), prefetch=1)
    hosts = {id(w.param): w.host.data_ptr() for b in streamer.blocks for w in b.weights}
    seen = []

    def count(*_):
        seen.append(sum(any(p.data_ptr() != hosts[id(p)] and p.untyped_storage().nbytes() > 0
                            for p in block.parameters()) for block in model.blocks))

    for block in model.blocks:
        block.attn.register_forward_hook(count)
    _loss(model, _tokens(model)).backward()
    assert max(seen) == 2 and len(seen) == 4, seen
    # At rest each parameter reads its view of the streamer's one host slab.
    assert all(p.untyped_storage().nbytes() == streamer.host_slab.numel() and p.data_ptr() == hosts[id(p)]
               for block in model.blocks for p in block.parameters()), "a parameter at rest must read its host copy"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["keep", "recompute"])
def test_offloaded_optimizer_steps_the_host_weights_the_next_forward_reads(checkpointing):
    """Three AdamW steps (two micro-batches each, clipped) equal plain fused AdamW within 1e-6."""
    model = _gpt()
    x = _tokens(model)
    plain = copy.deepcopy(model)
    reference = torch.optim.AdamW(plain.parameters(), fused=True, **HYPER)
    if checkpointing:
        apply_checkpointing(model)
    optimizer = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
    blocks = [p for b in model.blocks for p in b.parameters()]
    streamer = WeightStreamer(model, blocks=find_blocks(model), host_weights=optimizer.stream_weights(blocks))
    for m, opt in ((plain, reference), (model, optimizer)):
        acc = GradientAccumulator(m, opt, steps=2, max_grad_norm=0.5)
        for _ in range(3):
            for i in range(2):
                with acc.micro_batch(is_last=i == 1):
                    acc.backward(_loss(m, x), reduction="mean", items=1)
            acc.step()
    # Over the link in 3 steps: only the non-block weights go back after each step; every gradient comes down.
    outside = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    total = sum(p.numel() * 4 for p in model.parameters())
    assert optimizer.link_bytes == {"device_to_host": 3 * 2 * total, "host_to_device": 3 * outside}
    assert streamer.stats.link_bytes["host_to_device"] == 3 * 2 * 2 * sum(_block_bytes(model))
    got = model.state_dict()  # at rest the blocks' parameters read the host master
    worst = max((got[n] - v).abs().max().item() for n, v in plain.state_dict().items())
    assert worst <= 1e-6, f"max abs parameter difference after 3 steps {worst:.3g}"


def test_bf16_device_weights_stream_the_cast_and_land_gradients_beside_it():
    """bf16 device weights: the host cast is what streams, and gradients of a second micro-batch must not land in it
    (the optimizer's shared stage would overwrite the weights the next forward reads)."""
    model = _gpt()
    x = _tokens(model)
    twin = copy.deepcopy(model)
    results = []
    for m, stream in ((twin, False), (model, True)):
        opt = CPUOffloadOptimizer(m.named_parameters(), device_dtype=torch.bfloat16, **HYPER)
        if stream:
            WeightStreamer(m, blocks=find_blocks(m), host_weights=opt.stream_weights([p for b in m.blocks for p in b.parameters()]))
        for _ in range(2):
            for _ in range(2):
                _loss(m, x).backward()
            opt.step()
            opt.zero_grad()
        results.append({n: w.clone() for n, w in opt.master_weights().items()})
        results[-1] = [results[-1][id(p)] for p in m.parameters()]
    worst = max((a - b).abs().max().item() for a, b in zip(*results, strict=True))
    assert worst == 0.0, f"max abs master difference {worst:.3g}"


def test_close_gives_the_parameters_back_on_the_device():
    model = _gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    streamer = WeightStreamer(model, blocks=find_blocks(model))
    streamer.close()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    _loss(model, _tokens(model)).backward()  # no hooks left: plain training
    assert streamer.stats.fills == len(model.blocks)


class _Quantised(nn.Parameter):
    """Stands for a quantised weight's parameter subclass (bitsandbytes' Params4bit)."""


def test_bad_input_names_the_fix():
    with pytest.raises(ConfigError, match="prefetch=1"):
        WeightStreamer(_gpt(), blocks=["blocks.0"], prefetch=-1)
    with pytest.raises(ConfigError, match="no repeated blocks"):
        WeightStreamer(nn.Sequential(nn.Linear(2, 2)), blocks=[])
    tied = _gpt()
    tied.blocks[1].mlp.fc.weight = tied.blocks[0].mlp.fc.weight
    with pytest.raises(ConfigError, match="shared by blocks 0 and 1"):
        WeightStreamer(tied, blocks=find_blocks(tied))
    with pytest.raises(ConfigError, match="has no modules"):
        WeightStreamer(_gpt(), blocks=["blocks.9"])
    model = _gpt()
    WeightStreamer(model, blocks=find_blocks(model))
    with pytest.raises(ConfigError, match="streamed already"):
        WeightStreamer(model, blocks=find_blocks(model))
    odd = _gpt()
    odd.blocks[0].ln_1.weight = _Quantised(odd.blocks[0].ln_1.weight.detach())
    with pytest.raises(ConfigError, match="of type _Quantised"):
        WeightStreamer(odd, blocks=find_blocks(odd))
    model = _gpt()
    with pytest.raises(ConfigError, match="shape and dtype"):
        WeightStreamer(model, blocks=find_blocks(model), host_weights={id(model.blocks[0].ln_1.weight): torch.zeros(3)})


def test_a_step_interrupted_in_backward_leaves_nothing_on_the_device_after_the_next():
    """An out-of-memory error in backward (train's retry path) leaves blocks resident and a backward half done: the
    next step's forward sends them back, and its backward brings each block in again, with plain gradients."""
    model = _gpt()
    x = _tokens(model)
    expected = _grads(copy.deepcopy(model), x, micro_batches=1)
    streamer = WeightStreamer(model, blocks=find_blocks(model))

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("out of memory (simulated)")

    def arm(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(fail)

    handle = model.blocks[1].register_forward_hook(arm)
    loss = _loss(model, x)
    handle.remove()
    with pytest.raises(RuntimeError, match="simulated"):
        loss.backward()
    assert streamer.stats.resident_blocks > 0  # what the interrupted backward left
    model.zero_grad(set_to_none=True)
    streamer.stats.reset_peaks()
    got = _grads(model, x, micro_batches=1)
    assert streamer.stats.resident_blocks == 0 and streamer.stats.peak_resident_blocks <= 2, streamer.stats
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    assert worst <= 1e-6, f"max abs gradient difference {worst:.3g}"


def test_a_model_of_blocks_only_streams_every_weight():
    """Every parameter in a block: the optimizer's step copies nothing back to the device."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    plain = copy.deepcopy(model)
    reference = torch.optim.AdamW(plain.parameters(), fused=True, **HYPER)
    optimizer = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
    WeightStreamer(model, blocks=find_blocks(model), host_weights=optimizer.stream_weights(list(model.parameters())))
    x = torch.randn(4, 8, requires_grad=True)  # the first block's input takes a gradient: its release is tested
    for m, opt in ((plain, reference), (model, optimizer)):
        for _ in range(3):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert optimizer.link_bytes["host_to_device"] == 0
    worst = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), plain.state_dict().values(),
                                                          strict=True))
    assert worst <= 1e-6, worst
