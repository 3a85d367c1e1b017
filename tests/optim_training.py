"""What the lean-AdamW tests share: a small model whose largest weight int8 quantises, variable-length batches,
and training loops through GradientAccumulator (torch AdamW or build_optimizer's) and with lagged clipping."""

from __future__ import annotations

import torch
from torch import nn

from memtrain.accumulation import GradientAccumulator
from memtrain.optim import build_optimizer

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def make_model(seed: int = 0) -> nn.Module:
    # Linear(64, 128)'s weight has 8,192 elements: int8 quantises it (tensors under 4,096 keep fp32 moments).
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6 + i % 3, 16, generator=g) * 2, torch.randn(6 + i % 3, 4, generator=g)) for i in range(n)]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def train(options: dict | None, *, steps: int = 6, micro: int = 3, max_norm: float | None = None,
          scaler_scale: float | None = None, schedule: bool = False, overflow_at: int | None = None):
    """Trains make_model() through GradientAccumulator (sum-reduced, variable lengths); options=None: torch AdamW."""
    model = make_model()
    if options is None:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    else:
        opt = build_optimizer(model.named_parameters(), **HYPER, **options)
    scaler = None
    if scaler_scale is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale)
        if options is not None:
            opt.grad_scaler = scaler  # what build_optimizer(grad_scaler=...) sets
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    acc = GradientAccumulator(model, opt, steps=micro, max_grad_norm=max_norm, scaler=scaler, scheduler=scheduler)
    data = batches(steps * micro)
    results = []
    for step in range(steps):
        for m in range(micro):
            x, y = data[step * micro + m]
            with acc.micro_batch(is_last=m == micro - 1):
                loss = ((model(x) - y) ** 2).sum()
                if step == overflow_at:
                    loss = loss * 1e38  # overflows the scaled gradients: the step must be skipped
                acc.backward(loss, reduction="sum", items=x.shape[0])
        results.append(acc.step())
    return model, opt, results


def train_lagged_clipping(max_norm: float, *, steps: int = 6, micro: int = 3):
    """torch AdamW in a plain loop with lagged clipping (what step-in-backward does in one backward pass): window
    t's normalised gradient is multiplied by min(1, max_norm / (norm of window t-1 + 1e-6)); the first window is
    not clipped. Returns the model and each window's norm before clipping."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = batches(steps * micro)
    previous, norms = None, []
    for step in range(steps):
        items = 0
        for m in range(micro):
            x, y = data[step * micro + m]
            ((model(x) - y) ** 2).sum().backward()
            items += x.shape[0]
        grads = [p.grad for p in model.parameters()]
        torch._foreach_mul_(grads, 1 / items)
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if previous is not None:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (previous + 1e-6), max=1.0))
        opt.step()
        scheduler.step()
        opt.zero_grad()
        previous = norm
        norms.append(float(norm))
    return model, norms
