"""memtrain.optim.partial: a partly host-offloaded AdamW matches torch (fp16 scaler too), and normalises,
unscales and clips without a pass over the host gradients."""

from __future__ import annotations

import pytest
import torch
from optim_training import HYPER, batches, make_model, max_diff, train

from memtrain.accumulation import GradientAccumulator
from memtrain.optim import (
    build_optimizer,
)


def test_partial_offload_with_fp16_scaler_matches_torch() -> None:
    ref, _, ref_results = train(None, scaler_scale=2.0**10, max_norm=0.5, overflow_at=3)
    ours, _, results = train({"offload_fraction": 0.5}, scaler_scale=2.0**10, max_norm=0.5, overflow_at=3)
    assert [r.skipped for r in results] == [r.skipped for r in ref_results] == [i == 3 for i in range(6)]
    assert max_diff(ref, ours) <= 1e-6, f"max abs difference {max_diff(ref, ours):.3e}"


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
def test_a_partial_offload_normalises_unscales_and_clips_without_a_pass_over_host_gradients(fp16) -> None:
    """ComposedOptimizer's host part through GradientAccumulator (3 micro-batches, clipping active): between the last
    backward and the host step no aten op reads or writes a host gradient buffer (the old code multiplied them
    by 1/items, unscaled them and multiplied them by the clip coefficient, a pass each)."""
    from helpers import Touches

    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, offload_fraction=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if fp16 else None
    opt.grad_scaler = scaler
    acc = GradientAccumulator(model, opt, steps=3, max_grad_norm=0.5, scaler=scaler)
    storages = {s.grads[0].untyped_storage().data_ptr() for s in opt._host.slots}
    seen: list[list[str]] = []
    step = opt._host.step

    def counted_until_the_host_step(*args, **kwargs):
        seen.append(list(touches.ops))  # what touched host gradients before the host step began
        return step(*args, **kwargs)

    opt._host.step = counted_until_the_host_step
    data = batches(3)
    for m, (x, y) in enumerate(data):
        with acc.micro_batch(is_last=m == 2):
            acc.backward(((model(x) - y) ** 2).sum(), reduction="sum", items=x.shape[0])
    opt._host._landing.flush()
    for future in opt._host._landing.tasks:
        future.result()  # the landings (copies, adds, norms) are backward's work, done on the worker
    with Touches(storages) as touches:
        result = acc.step()
    assert seen == [[]], f"ops on host gradients before the host step: {seen}"
    assert result.grad_norm > 0.5, "clipping must be active to be tested"
