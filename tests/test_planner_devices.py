"""Tests of memtrain.planner: device figures: the table of known GPUs and the calibration cache."""

from __future__ import annotations

import pytest

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
