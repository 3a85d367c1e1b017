"""CPUOffloadOptimizer on a GPU: streams, pinned buffers and the device memory it saves. Skips without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memtrain.optim_offload import CPUOffloadOptimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 8))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 256, generator=g).cuda(), torch.randn(32, 8, generator=g).cuda()) for _ in range(n)]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.float().cpu() - q.float().cpu()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("mode", ["eager", "delayed", "in-backward"])
def test_matches_a_cpu_adamw_on_the_same_gradients(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streams and copies are exact: the GPU weights equal a CPU fused AdamW fed the same gradients."""
    monkeypatch.setattr(CPUOffloadOptimizer, "bucket_numel", 300_000)  # several buckets
    ours = make_model().cuda()
    twin = copy.deepcopy(ours)  # produces the gradients for the reference
    master = copy.deepcopy(ours).cpu()
    ref_opt = torch.optim.AdamW(master.parameters(), fused=True, **HYPER)
    delayed = mode == "delayed"
    opt = CPUOffloadOptimizer(ours.parameters(), delayed_update=delayed, **HYPER)
    for x, y in batches(10):
        for micro in range(2):  # two micro-batches: the second adds into the host buffer
            if micro == 1 and mode == "in-backward":
                opt.step_in_next_backward()
            nn.functional.mse_loss(ours(x), y).backward()
            nn.functional.mse_loss(twin(x), y).backward()
        assert all(p.grad is None for p in ours.parameters()), "device gradients were not freed"
        for p, q in zip(master.parameters(), twin.parameters(), strict=True):
            p.grad, q.grad = q.grad.cpu(), None
        if mode != "in-backward":
            norm = opt.clip_grad_norm_(0.5)
            ref_norm = torch.nn.utils.clip_grad_norm_(master.parameters(), 0.5)
            assert abs(norm.item() - ref_norm.item()) <= 1e-6 * ref_norm.item()
        if delayed:
            twin.load_state_dict(master.state_dict())  # update t-1 reaches the device at step t
        ref_opt.step()
        if not delayed:
            twin.load_state_dict(master.state_dict())
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    diff = max_diff(master, ours)
    assert diff <= 1e-6, f"max abs difference {diff:.3e}"


def test_bf16_weights_and_device_bytes_saved() -> None:
    model = make_model().cuda().to(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
    # cuBLAS keeps a workspace per (handle, stream) from the caching allocator, made by the first matmul of the
    # forward and of the backward thread: cleared before each reading, so only the optimizer's bytes can differ.
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for x, y in batches(3):
        nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    assert torch.cuda.memory_allocated() == base, "the optimizer left state or gradients on the device"
    sd = opt.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.cpu(), sd["state"][name]["master_weight"].to(torch.bfloat16))
