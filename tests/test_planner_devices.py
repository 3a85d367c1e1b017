"""Tests of memtrain.planner: device figures: the table of known GPUs and the calibration cache."""

from __future__ import annotations

import pytest
import torch

from memtrain.errors import ConfigError
from memtrain.planner import (
    calibrate,
    known_gpu,
)


# -- device figures -------------------------------------------------------------------------------------------
def test_calibration_is_cached_per_device(tmp_path, monkeypatch):
    import memtrain.planner.devices as devices

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = devices.probe

    def counting(device, name):
        calls.append(name)
        return real(device, name)

    monkeypatch.setattr(devices, "probe", counting)
    first = calibrate("cpu")
    second = calibrate("cpu")
    assert len(calls) == 1 and (tmp_path / "memtrain" / "calibration.json").is_file()
    assert first.matmul_flops == second.matmul_flops and "cached" in second.source
    assert first.matmul_flops > 0 and first.cpu_adamw > 0 and not first.asynchronous


def test_known_gpus_and_an_unknown_one():
    h200 = known_gpu("NVIDIA H200")
    assert h200.memory_bytes == int(141e9) and h200.host_to_device == 55e9 and "table" in h200.source
    with pytest.raises(ConfigError, match="--calibrate"):
        known_gpu("Voodoo 5")


def test_a_cpu_profile_rates_16_bit_matmuls_as_measured_beside_fp32(tmp_path, monkeypatch):
    """A CPU's bf16/fp16 matmuls run at the CPU's own rate (AMX: faster than fp32; AVX-512 without it: slower), and
    its 16-bit elementwise kernels take about fp32's time per element (half the bytes/s, not half the time): the
    probe measures both beside fp32's, a bf16-mixed step uses them, and a cached profile from before the 16-bit
    figures is probed again (it would rate bf16 as fp32)."""
    import json

    import memtrain.planner.devices as devices

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    profile = calibrate("cpu")
    assert profile.matmul_flops_bf16 and profile.matmul_flops_fp16, profile
    assert profile.memory_bandwidth_bf16 and profile.memory_bandwidth_fp16, profile
    bf16, fp16 = profile.for_precision("bf16-mixed"), profile.for_precision("fp16-mixed")
    assert (bf16.matmul_flops, bf16.memory_bandwidth) == (profile.matmul_flops_bf16, profile.memory_bandwidth_bf16)
    assert (fp16.matmul_flops, fp16.memory_bandwidth) == (profile.matmul_flops_fp16, profile.memory_bandwidth_fp16)
    assert profile.for_precision("fp32") is profile
    h200 = known_gpu("NVIDIA H200")  # a GPU's table rate is already bf16's
    assert h200.for_precision("bf16-mixed") is h200
    cache = tmp_path / "memtrain" / "calibration.json"
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        del entry["matmul_flops_bf16"], entry["matmul_flops_fp16"]
    cache.write_text(json.dumps(entries))
    calls = []
    monkeypatch.setattr(devices, "probe", lambda device, name: calls.append(name) or profile)
    assert calibrate("cpu") is profile and len(calls) == 1


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_a_plan_on_the_cpu_times_its_matmuls_at_the_16_bit_rate(precision):
    """The same CPU with 16-bit matmuls 8x slower than fp32 (no AMX) predicts a slower bf16-mixed step than with
    them as fast: the cost model reads the rate of the step's dtype, not fp32's."""
    import dataclasses

    from memtrain.models import GPT, GPT_PRESETS
    from memtrain.planner import plan

    base = dataclasses.replace(known_gpu("NVIDIA H200"), asynchronous=False, matmul_flops=50e9,
                               half_efficiency_tokens=0.0, op_overhead_s=0.0)
    model = GPT(GPT_PRESETS["gpt-mini"])
    seconds = {}
    for name, rate in (("as fast", 50e9), ("8x slower", 50e9 / 8)):
        profile = dataclasses.replace(base, matmul_flops_bf16=rate, matmul_flops_fp16=rate)
        seconds[name] = plan(model, budget=None, seq_len=128, global_batch_size=8, device="cpu", precision=precision,
                             micro_batch_size=8, device_profile=profile, techniques=()).step_seconds
    assert seconds["8x slower"] > 2 * seconds["as fast"], seconds
    # The plan's device-figures line states the rate its step was timed at.
    shown = plan(model, budget=None, seq_len=128, global_batch_size=8, device="cpu", precision=precision,
                 micro_batch_size=8, device_profile=profile, techniques=()).assumptions[0]
    assert "matmuls 6.2 GFLOP/s" in shown, shown


def test_a_probe_leaves_the_global_generator_as_it_found_it(monkeypatch, tmp_path) -> None:
    """calibrate()'s probe draws random tensors; a run that probes (a fresh machine) must draw the same dropout masks
    and data order as one that reads the cache, or a killed run's resume is not the straight run (it was not)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    calibrate("cpu", cache=False, refresh=True)
    assert torch.equal(torch.get_rng_state(), before)
