"""The optimizer's bytes: state by kind, offloaded state on the host, Adafactor's factored moments, one byte
model with memtrain.optim."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memtrain.choices import Choices, OptimizerChoice
from memtrain.estimate import estimate
from memtrain.models import GPT, GPT_PRESETS


@pytest.mark.parametrize("optimizer, factor", [("sgd", 0), ("sgd-momentum", 1), ("adamw", 2)])
def test_optimizer_state_by_kind(optimizer, factor):
    model = GPT(GPT_PRESETS["gpt-tiny"])
    r = estimate(model, (2, 64), device="cpu", optimizer=optimizer)
    assert r.optimizer_state_bytes == factor * r.parameter_bytes, (optimizer, r.optimizer_state_bytes)


def test_offloaded_optimizer_state_moves_to_the_host():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    on_device = estimate(model, (2, 64), device="cpu", optimizer="adamw")
    offloaded = estimate(model, (2, 64), device="cpu", optimizer="adamw-offload")
    n = sum(p.numel() for p in model.parameters())
    # fp32 master, two moments and a gradient buffer (16 bytes a parameter), plus step counters and alignment
    assert 16 * n <= offloaded.host_bytes <= 16.2 * n, (offloaded.host_bytes, 16 * n)
    assert on_device.peak_bytes - offloaded.peak_bytes == on_device.optimizer_state_bytes


def test_adafactor_state_is_factored():
    layer = nn.Sequential(nn.Linear(256, 512, bias=False))
    r = estimate(layer, torch.zeros(4, 256, device="meta"), device="cpu", optimizer="adafactor")
    assert r.optimizer_state_bytes == (512 + 256) * 4, r.optimizer_state_bytes  # a row and a column, fp32


@pytest.mark.parametrize("weights_dtype", [None, "bf16"])
def test_the_offloaded_adamws_bytes_are_optimizer_memorys_byte_for_byte(weights_dtype):
    """optimizer="adamw-offload" (CPUOffloadOptimizer, every parameter's state on the host) and
    memtrain.optim.optimizer_memory(offload_fraction=1.0) are one byte model: they cannot drift apart."""
    from memtrain.optim import optimizer_memory

    model = GPT(GPT_PRESETS["gpt-tiny"])
    dtype = torch.bfloat16 if weights_dtype else torch.float32
    params = [(p.numel(), dtype) for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    want = optimizer_memory(params, offload_fraction=1.0, device_type="cpu")
    for kwargs in ({"optimizer": "adamw-offload"},
                   {"optimizer": "adamw", "setup": Choices(optimizer=OptimizerChoice(offload_fraction=1.0))}):
        got = estimate(model, (2, 16), device="cpu", weights_dtype=weights_dtype, **kwargs)
        assert got.host_bytes == want.host_bytes, (kwargs, weights_dtype, got.host_bytes, want.host_bytes)
        assert got.optimizer_state_bytes == want.state_bytes, (kwargs, got.optimizer_state_bytes, want.state_bytes)
