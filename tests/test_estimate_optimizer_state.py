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
    steps = 4 * len(list(model.parameters())) if optimizer == "adamw" else 0  # AdamW's step: a float32 tensor each
    assert r.optimizer_state_bytes == factor * r.parameter_bytes + steps, (optimizer, r.optimizer_state_bytes)


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
    assert r.optimizer_state_bytes == (512 + 256) * 4 + 4, r.optimizer_state_bytes  # a row, a column, the step


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


class _SecondLinearUnused(nn.Module):
    """Two Linear layers, the second never called: it gets no gradient, so no optimizer creates state for it."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        return self.used(x)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), fused=True)


def _lean(model):
    from memtrain.optim import build_optimizer

    return build_optimizer(model.named_parameters(), lr=1e-3, state_precision="bf16")


def _offloaded(model):
    from memtrain.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("build, optimizer, setup", [
    (_adamw, "adamw", None),
    (lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9), "sgd-momentum", None),
    (_lean, "adamw", Choices(optimizer=OptimizerChoice(state_precision="bf16"))),
    (_offloaded, "adamw-offload", None),
], ids=["adamw", "sgd-momentum", "lean-bf16", "offload"])
def test_state_only_for_parameters_that_get_gradients(build, optimizer, setup):
    """The issue's case: 1,052,672 bytes of AdamW state predicted, 526,344 real (the unused Linear has none)."""
    from memtrain import measure

    torch.manual_seed(0)
    model = _SecondLinearUnused()
    opt = build(model)
    x = torch.randn(4, 256)
    for _ in range(2):  # the second step is the steady state: the state exists
        measured = measure(model, x, optimizer=opt)
        opt.zero_grad(set_to_none=True)
    r = estimate(model, x, device="cpu", optimizer=optimizer, setup=setup)
    assert r.optimizer_state_bytes == measured.optimizer_state_bytes, (r.optimizer_state_bytes,
                                                                      measured.optimizer_state_bytes)
    assert r.gradient_bytes == measured.gradient_bytes, (r.gradient_bytes, measured.gradient_bytes)
    assert any("unused.weight" in a for a in r.assumptions), r.assumptions
