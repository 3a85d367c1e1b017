"""ComposedOptimizer's load into its host part (CPUOffloadOptimizer.load_entries): converted bf16 moments are the
entries ``entry_for`` gives, each salted by its parameter's place (after the device part's), and entries naming no
host parameter are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memtrain.errors import ConfigError
from memtrain.optim import build_optimizer, moments_of
from memtrain.optim.moments import entry_for

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))


def _fp32_state(model: nn.Module) -> dict:
    """An fp32 AdamW state of ``model`` after one step, keyed by parameter name."""
    source = build_optimizer(model.named_parameters(), **HYPER)
    model(torch.randn(4, 8)).square().sum().backward()
    source.step()
    source.zero_grad()
    return source.state_dict()


def test_an_fp32_state_loads_into_bf16_host_moments_salted_after_the_device_part() -> None:
    """Each host entry is bit-equal to ``entry_for(inner, master, moments, salt=len(device_params) + i)`` (i: its
    place among the host parameters, in param_groups order), and no two parameters, device or host, share a salt
    (a shared salt would give two parameters the same rounding noise)."""
    model = _model()
    saved = _fp32_state(model)
    opt = build_optimizer(model.named_parameters(), **HYPER, state_precision="bf16", offload_fraction=0.5)
    try:
        opt.load_state_dict(saved)
        host, device_params = opt._host, opt._device_params
        assert host is not None and len(host.slots) >= 2 and len(device_params) >= 2, (
            f"the fixture must split the parameters: {len(device_params)} on the device, "
            f"{0 if host is None else len(host.slots)} on the host")
        salts = [opt.state[p]["salt"] for p in device_params]
        for i, slot in enumerate(host.slots):
            inner = host.stepper.buckets[slot.bucket].inner
            expected = entry_for(inner, slot.master, moments_of(saved["state"][slot.key]),
                                 salt=len(device_params) + i)
            got = inner.state[slot.master]
            assert got.keys() == expected.keys(), f"{slot.key}: keys {sorted(got)} vs {sorted(expected)}"
            for k, want in expected.items():
                have = got[k]
                if isinstance(want, torch.Tensor):
                    assert have.dtype == want.dtype and torch.equal(have, want), (
                        f"{slot.key}[{k}]: {have.dtype} vs {want.dtype}, max abs diff "
                        f"{(have.float() - want.float()).abs().max().item()}")
                else:
                    assert have == want, f"{slot.key}[{k}]: {have} vs {want}"
            salts.append(got["salt"])
        assert sorted(salts) == list(range(len(salts))), f"salts {salts}: each parameter its own"
    finally:
        opt.close()


def test_host_entries_naming_no_host_parameter_are_refused() -> None:
    """``load_entries`` checks that every name is one of its parameters' (a typo would otherwise drop that state
    silently)."""
    model = _model()
    saved = _fp32_state(model)
    opt = build_optimizer(model.named_parameters(), **HYPER, offload_fraction=0.5)
    try:
        host = opt._host
        name = host.slots[0].key
        entry = moments_of(saved["state"][name])
        host.load_entries({}, {name: entry}, {})  # its own: loads
        with pytest.raises(ConfigError, match=r"'0\.weight'.*To resolve this error"):
            host.load_entries({}, {name: entry, "0.weight": entry}, {})
    finally:
        opt.close()
