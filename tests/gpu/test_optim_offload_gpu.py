"""CPUOffloadOptimizer on a GPU: streams, pinned buffers and the device memory it saves. Skips without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memtrain.optim import CPUOffloadOptimizer

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


# -- memtrain.optim.ComposedOptimizer on a GPU ------------------------------------------------------------------------
def _train_lean(options: dict | None, *, steps: int = 6, max_norm: float | None = 0.5) -> nn.Module:
    """make_model() on CUDA through GradientAccumulator (2 micro-batches); options=None: fused torch AdamW."""
    from memtrain.accumulation import GradientAccumulator
    from memtrain.optim import build_optimizer

    model = make_model().cuda()
    if options is None:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    else:
        opt = build_optimizer(model.named_parameters(), **HYPER, **options)
    acc = GradientAccumulator(model, opt, steps=2, max_grad_norm=max_norm)
    data = batches(2 * steps)
    for step in range(steps):
        for m in range(2):
            x, y = data[2 * step + m]
            with acc.micro_batch(is_last=m == 1):
                acc.backward(nn.functional.mse_loss(model(x), y), reduction="mean")
        acc.step()
    if hasattr(opt, "close"):
        opt.close()
    return model


@pytest.mark.parametrize("options", [{"step_in_backward": True}, {"offload_fraction": 0.5},
                                     {"offload_fraction": 0.5, "step_in_backward": True}],
                         ids=["in-backward", "half-offloaded", "both"])
def test_lean_adamw_matches_fused_adamw(options: dict) -> None:
    """fp32 state: the same weights as fused AdamW, with clipping active where the clip is exact (step-in-backward
    clips by the previous window's norm, so there: clipping inactive; tests/test_optim.py checks the lagged clip
    against torch on the CPU). The tolerance allows the norm's device order to differ by rounding."""
    max_norm = 1e9 if options.get("step_in_backward") else 0.5
    ref = _train_lean(None, max_norm=max_norm)
    ours = _train_lean(options, max_norm=max_norm)
    diff = max_diff(ref, ours)
    assert diff <= 1e-5, f"{options}: max abs difference {diff:.3e} (tolerance 1e-5)"


def test_step_in_backward_lowers_the_device_peak_by_the_gradients() -> None:
    from memtrain.optim import build_optimizer

    peaks = {}
    for step_in_backward in (False, True):
        model = make_model().cuda()
        opt = build_optimizer(model.named_parameters(), **HYPER, step_in_backward=step_in_backward)
        x, y = batches(1)[0]
        for _ in range(2):  # the second step runs with the optimizer state already allocated
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            peaks[step_in_backward] = torch.cuda.max_memory_allocated() - base
        opt.close()
    grads = [p.numel() * 4 for p in make_model().parameters()]
    saved = peaks[False] - peaks[True]
    assert saved >= 0.9 * (sum(grads) - max(grads)), (
        f"step-in-backward saved {saved} bytes at the peak; the gradients but the largest are {sum(grads) - max(grads)}")


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_low_precision_state_on_the_gpu_trains_and_holds_the_predicted_bytes(precision: str) -> None:
    if precision == "int8":
        pytest.importorskip("bitsandbytes")
    from memtrain.measure import optimizer_state_bytes
    from memtrain.optim import build_optimizer, optimizer_memory

    final = {}
    for state in ("fp32", precision):
        model = make_model().cuda()
        opt = build_optimizer(model.named_parameters(), **HYPER, state_precision=state)
        losses = []
        for x, y in batches(30):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        final[state] = losses[-1]
    assert all(v.is_cuda for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    predicted = optimizer_memory([(p.numel(), p.dtype) for p in model.parameters()], state_precision=precision,
                                 device_type="cuda")
    assert optimizer_state_bytes(opt) == predicted.device_state_bytes
    rel = abs(final[precision] / final["fp32"] - 1)
    assert rel <= 0.05, f"{precision}: final loss {final[precision]:.4f} vs fp32 {final['fp32']:.4f}"


@pytest.mark.parametrize("options", [{}, {"step_in_backward": True}, {"offload_fraction": 0.5},
                                     {"offload_fraction": 1.0}],
                         ids=["device", "in-backward", "half-offloaded", "offloaded"])
def test_a_named_class_on_the_gpu_trains_as_the_plain_class(options: dict) -> None:
    """Adafactor through memtrain's wrappers on the GPU (issue 30): the weights of torch's Adafactor on the device
    (tolerance 1e-5: the host steps its share on the CPU's kernels), and its device state as the probe predicts."""
    from memtrain.optim import build_optimizer, optimizer_memory
    from memtrain.techniques.optimizer import NamedOptimizer

    named = NamedOptimizer.of("adafactor")
    ref, ours = make_model().cuda(), make_model().cuda()
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(ours.named_parameters(), lr=1e-2, weight_decay=0.1, optimizer_class="adafactor",
                          **options)
    for x, y in batches(5):
        for model, o in ((ref, ref_opt), (ours, opt)):
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    diff = max_diff(ref, ours)
    assert diff <= 1e-5, f"{options}: max abs difference {diff:.3e} (tolerance 1e-5)"
    params = list(ours.parameters())
    predicted = optimizer_memory([(p.numel(), p.dtype) for p in params], named=named,
                                 shapes=[tuple(p.shape) for p in params], device_type="cuda",
                                 offload_fraction=options.get("offload_fraction", 0.0),
                                 step_in_backward=options.get("step_in_backward", False))
    on_device = sum(v.numel() * v.element_size() for p in params if p in opt.state
                    for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.is_cuda)
    # the step counter lives on the CPU (not fused): the device holds the factored moments alone
    assert on_device <= predicted.device_state_bytes, (on_device, predicted)
    opt.close()
