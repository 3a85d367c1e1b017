"""memtrain.optim.build: build_optimizer refuses bad input, naming the fix (and the fallback)."""

from __future__ import annotations

import sys

import pytest
import torch
from optim_training import make_model

from memtrain.errors import ConfigError
from memtrain.optim import (
    ComposedOptimizer,
    CPUOffloadOptimizer,
    build_optimizer,
    optimizer_memory,
)


def test_unknown_state_precision() -> None:
    with pytest.raises(ConfigError, match=r"state_precision='fp8' is not one of \['fp32', 'bf16', 'int8'\]"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, state_precision="fp8")
    with pytest.raises(ConfigError, match="state_precision"):
        optimizer_memory([(10, torch.float32)], state_precision="int4")


def test_int8_without_bitsandbytes_names_the_extra_and_the_fallback(monkeypatch) -> None:
    import memtrain.optim.moments as moments

    monkeypatch.setattr(moments, "_ADAMW8BIT", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"memtrain\[lowbit\].*state_precision='bf16'"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, state_precision="int8")


def test_int8_on_a_device_without_a_kernel_names_the_fallback() -> None:
    model = make_model().to("meta")
    with pytest.raises(ConfigError, match=r"'meta' device.*state_precision='bf16'"):
        build_optimizer(model.named_parameters(), lr=1e-3, state_precision="int8")


def test_other_bad_input() -> None:
    with pytest.raises(ConfigError, match=r"offload_fraction=1.5 must be a number in \[0, 1\]"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, offload_fraction=1.5)
    with pytest.raises(ConfigError, match="no parameter that requires grad"):
        build_optimizer(make_model().requires_grad_(False).named_parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match="not fp32.*offload_fraction=1.0"):
        build_optimizer(make_model().bfloat16().named_parameters(), lr=1e-3)
    # bf16 weights are fine offloaded: the host keeps their fp32 master.
    opt = build_optimizer(make_model().bfloat16().named_parameters(), lr=1e-3, offload_fraction=1.0)
    assert isinstance(opt, ComposedOptimizer) and isinstance(opt._host, CPUOffloadOptimizer)
    opt.close()
