"""Checkpointing on a real GPU: CUDA dropout masks in the recompute, and the peak it lowers. Skipped without CUDA.

Run on a GPU machine: ``.venv/bin/python -m pytest tests/gpu/test_checkpointing_gpu.py -q`` (seconds on an H200).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain import apply_checkpointing, measure
from memtrain.models import GPT, GPTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class KeywordDropoutBlock(nn.Module):
    """Takes its tensors by keyword, as Hugging Face decoder layers are called (``layer(hidden_states=h, ...)``)."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, *, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(hidden_states)) * mask


def _grads(blocks: nn.Module, call) -> list[torch.Tensor]:
    blocks.zero_grad(set_to_none=True)
    h = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones(64, 256, device="cuda")
    torch.manual_seed(3)  # seeds the CUDA generator too: the same dropout masks in both runs
    for block in blocks:
        h = call(block, h, mask)
    h.square().sum().backward()
    return [p.grad.clone() for p in blocks.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_keyword_called_dropout_blocks_recompute_the_same_masks():
    torch.manual_seed(0)
    blocks = nn.ModuleList(KeywordDropoutBlock() for _ in range(4)).cuda()
    twin = copy.deepcopy(blocks)
    expected = _grads(blocks, lambda b, h, m: b(hidden_states=h, mask=m))
    apply_checkpointing(twin)
    got = _grads(twin, lambda b, h, m: b(hidden_states=h, mask=m))
    # Other masks in the recompute change gradients by O(1); the tolerance allows a cuBLAS kernel choice only.
    diff = _max_diff(got, expected)
    assert diff <= 1e-5, f"checkpointed keyword-called dropout blocks: gradients differ by {diff:.3e}"
    # The defect memtrain fixes: torch's checkpoint with the tensors as keywords stashes no CUDA RNG state.
    plain = _grads(blocks, lambda b, h, m: checkpoint(b, use_reentrant=False, hidden_states=h, mask=m))
    assert _max_diff(plain, expected) > 1e-2, (
        "torch.utils.checkpoint now restores the CUDA RNG for keyword tensors: the workaround in "
        "memtrain.checkpointing.forward._keyword_tensors_positional can go")


def _peaks(fn) -> tuple[int, int]:
    """(max_memory_allocated, max_memory_reserved) over ``fn``, the cache emptied first."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def test_checkpointing_lowers_the_allocated_and_the_reserved_peak():
    """The peak falls by most of the saved activations checkpointing drops (measured exactly by the hooks)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=512, n_head=8, seq_len=1024, dropout=0.0)).cuda()
    idx = torch.randint(0, 256, (8, 1024), device="cuda")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(idx, idx).backward()

    step()  # warm-up: cuBLAS workspaces, the allocator's first segments
    plain_saved = measure(lambda: model(idx, idx), model=model).activation_bytes
    plain, plain_reserved = _peaks(step)
    apply_checkpointing(model)
    step()
    checkpointed_saved = measure(lambda: model(idx, idx), model=model).activation_bytes
    checkpointed, checkpointed_reserved = _peaks(step)
    dropped = plain_saved - checkpointed_saved
    assert dropped > 0, (plain_saved, checkpointed_saved)
    # Backward's recompute brings one block's activations back, so the peak falls by less than all of them.
    for what, before, after in (("allocated", plain, checkpointed), ("reserved", plain_reserved,
                                                                       checkpointed_reserved)):
        assert before - after >= dropped // 2, (
            f"{what} peak {before} -> {after} bytes: fell by {before - after}, expected >= {dropped // 2} (half "
            f"of the {dropped} saved bytes checkpointing drops)")


def _gpt_grads(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same CUDA dropout masks in every run
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, idx)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_selective_checkpointing_with_attention_dropout_recomputes_the_same_masks():
    """The fused SDPA kernel with dropout is recomputed, never kept: kept, it would skip its Philox offsets in the
    recompute and every dropout after it in the block would draw another mask."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, seq_len=128, dropout=0.1)).cuda()
    wrapped = copy.deepcopy(plain)
    apply_checkpointing(wrapped, selective=("matmul", "attention"))
    idx = torch.randint(0, 256, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for a, b in zip(_gpt_grads(plain, idx), _gpt_grads(wrapped, idx), strict=True):
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3e}"


@pytest.mark.slow  # inductor compiles every block, forward and backward: gpu_check.sh's `tests` stage, not quick
@pytest.mark.parametrize("set_up", ["all+offload", "blocks(ORKO)"])
def test_offloaded_activations_compile_per_block_with_inductor(set_up):
    """compile_model: every block compiled (inductor), the offloader outside; no graph break, gradients close to
    eager's (inductor fuses bf16 ops differently: tolerance 2e-2 relative)."""
    from memtrain.checkpointing import Checkpointing, compile_model
    from memtrain.measure import compile_counts

    torch.manual_seed(0)
    eager = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, seq_len=128)).cuda()
    model = copy.deepcopy(eager)
    Checkpointing.parse(set_up).apply(eager)
    Checkpointing.parse(set_up).apply(model)
    compiled = compile_model(model)
    idx = torch.randint(0, 256, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    expected = _gpt_grads(eager, idx)
    counts = compile_counts(lambda: _gpt_grads(compiled, idx))
    assert counts.graph_breaks == 0 and counts.eager_frames == 0 and counts.graphs >= 1, str(counts)
    got = _gpt_grads(compiled, idx)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
