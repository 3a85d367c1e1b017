"""Activation offload on a real GPU: parity, peak reduction, races, the host budget. Skipped without CUDA.

Run on a GPU machine: ``.venv/bin/python -m pytest tests/gpu/test_offload_gpu.py -q`` (under a minute on an H200).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from memtrain.checkpointing import apply_checkpointing
from memtrain.models import GPT, GPTConfig
from memtrain.offload import offload_activations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        diff = (got[name].float() - expected[name].float()).abs().max().item()
        assert torch.equal(got[name], expected[name]), f"{what}: {name} differs, max abs diff {diff}"


def gpt_step(model: GPT, idx: torch.Tensor, context=None, *, autocast: bool = False) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast)
    if context is None:
        with amp:
            loss = model(idx, idx)
    else:
        with amp, context:
            loss = model(idx, idx)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("autocast", [False, True])
def test_gpt_gradients_identical(autocast):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, seq_len=256)).cuda()
    offloader = offload_activations(model=model, min_bytes=2**16)
    for step in range(3):  # the first step records the order; the next ones prefetch by it
        idx = torch.randint(0, 256, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        # The math SDPA kernel is deterministic, so the two runs must match bit for bit.
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            gpt_step(model, idx, autocast=autocast)
            expected = grads(model)
            gpt_step(model, idx, offloader, autocast=autocast)
        assert_same_grads(grads(model), expected, f"step {step}")
    stats = offloader.stats()
    assert stats.offloaded_bytes > 0 and stats.prefetched > 0 and stats.learned_order_used >= 1, stats


def _peaks(fn) -> tuple[int, int]:
    """(max_memory_allocated, max_memory_reserved) over ``fn``. The cache is emptied first, so the reserved peak
    is what ``fn`` made the allocator hold: restored activations live in the side stream's pool, which the
    compute stream cannot reuse, so a lower allocated peak alone does not mean that a run fits."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def test_offloading_checkpointed_inputs_lowers_the_peak():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=12, n_embd=512, n_head=8, seq_len=1024)
    model = GPT(config).cuda()
    # Frozen blocks: their fp32 weight gradients (12 MiB each, nearly a block input's 16 MiB) would otherwise move
    # the peak to the end of backward, where the offloaded inputs are back or freed and little is saved.
    for block in model.blocks:
        block.requires_grad_(False)
    idx = torch.randint(0, 256, (8, 1024), device="cuda")
    block_input = 8 * 1024 * 512 * 4
    apply_checkpointing(model)
    gpt_step(model, idx)  # warm-up: allocator, cuBLAS workspaces
    expected = grads(model)
    checkpointed, checkpointed_reserved = _peaks(lambda: gpt_step(model, idx))
    offloader = offload_activations()  # per block: no model, so no head to watch
    apply_checkpointing(model, offload=True, offloader=offloader)
    gpt_step(model, idx)
    offloaded, offloaded_reserved = _peaks(lambda: gpt_step(model, idx))
    assert_same_grads(grads(model), expected, "checkpointing + offload")
    saved = checkpointed - offloaded
    # All but the blocks whose inputs are still in flight or already back (prefetch depth, copies in flight)
    # leave the device.
    assert saved >= (config.n_layer - 6) * block_input, (
        f"peak {checkpointed} -> {offloaded} bytes: saved {saved}, expected >= {(config.n_layer - 6) * block_input}")
    # Reserved: the side stream's pool holds up to prefetch_depth + 1 restored inputs (and a rounding's worth)
    # that the compute stream cannot reuse; the rest of what the allocated peak lost must leave the cache too.
    saved_reserved = checkpointed_reserved - offloaded_reserved
    side_pool = (offloader.prefetch_depth + 2) * block_input
    assert saved_reserved > 0 and saved_reserved >= saved - side_pool, (
        f"reserved peak {checkpointed_reserved} -> {offloaded_reserved} bytes: saved {saved_reserved}, expected "
        f">= {saved - side_pool} (the allocated peak's {saved} less a side-stream pool of {side_pool})")
    assert offloader.stats().offloaded_bytes >= config.n_layer * block_input, offloader.stats()


def test_whole_forward_offload_lowers_the_peak():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=512, n_head=8, seq_len=512)).cuda()
    idx = torch.randint(0, 256, (8, 512), device="cuda")
    gpt_step(model, idx)
    plain, plain_reserved = _peaks(lambda: gpt_step(model, idx))
    offloader = offload_activations(model=model)
    gpt_step(model, idx, offloader)
    offloaded, offloaded_reserved = _peaks(lambda: gpt_step(model, idx, offloader))
    moved = offloader.stats().offloaded_bytes // 2  # bytes of one step (two steps ran)
    assert plain - offloaded >= moved // 2, f"peak {plain} -> {offloaded} bytes with {moved} bytes offloaded per step"
    assert plain_reserved - offloaded_reserved >= moved // 4, (
        f"reserved peak {plain_reserved} -> {offloaded_reserved} bytes with {moved} bytes offloaded per step")


def test_nothing_restored_is_held_through_the_optimizer_step():
    """After backward (before the optimizer step) the device holds what a plain step leaves: parameters,
    gradients, the batch. Restored inputs and copy sources are dropped by the end-of-backward callback."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=512, n_head=8, seq_len=1024)).cuda()
    idx = torch.randint(0, 256, (4, 1024), device="cuda")
    apply_checkpointing(model)
    gpt_step(model, idx)
    torch.cuda.synchronize()
    plain = torch.cuda.memory_allocated()
    offloader = offload_activations()
    apply_checkpointing(model, offload=True, offloader=offloader)
    for _ in range(2):
        gpt_step(model, idx)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        assert held == plain, f"{held - plain} bytes more on the device after backward than without offload"
    assert offloader.stats().offloaded_bytes > 0 and offloader.stats().host_used_bytes == 0, offloader.stats()


class Cheap(nn.Module):
    """A layer of little arithmetic on a big tensor: copies are far slower than compute, so any missing
    synchronisation reads a half-copied or stale buffer."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * self.scale  # saves x and sin(x): two fresh storages per layer


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_race_many_cheap_layers(depth):
    torch.manual_seed(0)
    width = 4096
    model = nn.Sequential(*[Cheap(width) for _ in range(24)]).cuda()  # 48 x 32 MiB saved per step
    offloader = offload_activations(model=model, prefetch_depth=depth)
    for step in range(3):  # fresh inputs each step: a stale pinned block from the last step would show
        x = torch.randn(2048, width, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        expected = grads(model)
        model.zero_grad(set_to_none=True)
        with offloader:
            loss = model(x).square().sum()
        loss.backward()
        assert_same_grads(grads(model), expected, f"depth {depth}, step {step}")
    stats = offloader.stats()
    assert stats.offloaded_bytes >= 3 * 40 * 2048 * width * 4, stats


def test_race_on_a_non_default_stream():
    """The compute stream is whatever stream is current: the side stream must wait for it, not the default."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Cheap(4096) for _ in range(12)]).cuda()
    x = torch.randn(2048, 4096, device="cuda")
    model(x).square().sum().backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    offloader = offload_activations(model=model)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with offloader:
            loss = model(x).square().sum()
        loss.backward()
    torch.cuda.current_stream().wait_stream(stream)
    assert_same_grads(grads(model), expected, "side compute stream")


def test_host_budget_is_respected():
    torch.manual_seed(0)
    model = nn.Sequential(*[Cheap(4096) for _ in range(16)]).cuda()  # 32 x 32 MiB saved
    x = torch.randn(2048, 4096, device="cuda")
    model(x).square().sum().backward()
    expected = grads(model)
    budget = 256 * 2**20
    offloader = offload_activations(model=model, host_budget_bytes=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with offloader:
                loss = model(x).square().sum()
            loss.backward()
    assert_same_grads(grads(model), expected, "over the host budget")
    stats = offloader.stats()
    assert stats.host_reserved_bytes <= budget and stats.host_peak_used_bytes <= budget, stats
    assert stats.over_budget_bytes > 0 and stats.offloaded_bytes >= budget // 2, stats
    assert sum("host budget" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
    assert offloader.pool.slabs and all(s.is_pinned() for s in offloader.pool.slabs)
