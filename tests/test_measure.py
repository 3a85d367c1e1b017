"""measure / MemoryMeter: exact bytes, checked against hand-computed expectations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from memtrain import MemoryMeter, MemoryReport, MemtrainError, measure
from memtrain.device import SimulatedAccelerator, simulate
from memtrain.errors import ConfigError
from memtrain.report import format_bytes, parse_bytes


def test_linear_saves_exactly_its_input():
    layer = nn.Linear(16, 8)
    report = measure(layer, torch.randn(4, 16))
    assert report.activation_bytes == 4 * 16 * 4  # batch x in_features x fp32; the weight is model state
    assert report.activation_tensors == 1
    assert report.parameter_bytes == (16 * 8 + 8) * 4
    assert report.gradient_bytes == (16 * 8 + 8) * 4


def test_views_and_tensors_saved_twice_count_once():
    x = torch.randn(8, 32, requires_grad=True)

    def fn():
        y = x * 2  # saves nothing of y; y is new storage
        a = y[:4]  # a view of y
        return (a * a).sum() + (y * y).sum()  # mul saves a (view of y) and y itself

    report = measure(fn)
    # x is a leaf that requires grad: treated as a parameter without a model. y counts once: 8 x 32 x 4 bytes.
    assert report.activation_bytes == 8 * 32 * 4, report


def test_parameters_and_buffers_saved_by_ops_are_not_activations():
    bn = nn.BatchNorm1d(10)
    x = torch.randn(6, 10)
    report = measure(bn, x)
    # batch_norm saves its input (6 x 10) and the batch mean / inverse std (10 each); weight and running stats
    # are model state.
    assert report.activation_bytes == (6 * 10 + 10 + 10) * 4, report


def test_optimizer_state_and_phases():
    model = nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    report = measure(model, torch.randn(3, 10), optimizer=opt)
    n = 10 * 10 + 10
    state_tensors = 2 * n * 4  # exp_avg + exp_avg_sq
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert report.optimizer_state_bytes == state_tensors + steps
    assert report.model_state_bytes == report.parameter_bytes + report.gradient_bytes + report.optimizer_state_bytes
    assert report.peak_bytes is None  # no allocator to read on the CPU


def test_meter_context_and_hugging_face_style_output():
    class Out:
        def __init__(self, loss):
            self.loss = loss

    model = nn.Linear(4, 1)
    with MemoryMeter(model) as meter:
        Out(model(torch.randn(5, 4)).pow(2).mean()).loss.backward()
    assert meter.activation_bytes == 5 * 4 * 4 + 5 * 1 * 4  # linear input, pow input
    assert measure(lambda: Out(model(torch.randn(5, 4)).sum()), model=model).activation_bytes == 5 * 4 * 4


def test_measure_rejects_non_tensor_output():
    with pytest.raises(MemtrainError, match="not a tensor"):
        measure(lambda: "loss")


def test_report_summary_and_dict():
    report = MemoryReport(parameter_bytes=2**30, gradient_bytes=2**30, optimizer_state_bytes=2**31,
                          activation_bytes=3 * 2**20, activation_tensors=7, assumptions=("fp32",))
    table = report.summary()
    assert "parameters" in table and "1.00 GiB" in table and "3.00 MiB" in table and "assumes: fp32" in table
    d = report.to_dict()
    assert d["total_bytes"] == 4 * 2**30 + 3 * 2**20 and d["assumptions"] == ["fp32"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.parameter_bytes = 0  # type: ignore[misc]


@pytest.mark.parametrize("text,expected", [("24GiB", 24 * 2**30), ("1.5 GB", 1_500_000_000), ("512MiB", 2**29),
                                           ("4096", 4096), ("8g", 8 * 2**30)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "5 parsecs"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError, match="To resolve this error"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(None) == "-"


def _count_device_calls(monkeypatch) -> list[str]:
    """Records every call the meter makes into the simulated device's allocator (its peak fixed at 4096 bytes)."""
    calls = []
    monkeypatch.setattr(SimulatedAccelerator, "synchronize", lambda self: calls.append("synchronize"))
    monkeypatch.setattr(SimulatedAccelerator, "reset_peak_memory_stats", lambda self: calls.append("reset"))
    monkeypatch.setattr(SimulatedAccelerator, "memory_allocated", lambda self: 1000)
    monkeypatch.setattr(SimulatedAccelerator, "max_memory_allocated", lambda self: 4096)
    return calls


def test_a_meter_that_must_not_stall_the_queue_reads_the_peak_without_synchronising(monkeypatch):
    calls = _count_device_calls(monkeypatch)
    x = torch.randn(4, 8, requires_grad=True)
    with simulate("1MiB"):
        with MemoryMeter(synchronize=False) as meter:
            y = x * 2  # saves nothing (a constant factor); y is saved by the product below
            (y * y).sum().backward()
            meter.mark("backward")
        report = meter.report()
        assert "synchronize" not in calls and calls.count("reset") == 1, calls
        assert report.peak_bytes == 4096 and report.activation_bytes == 4 * 8 * 4
        calls.clear()
        measure(lambda: (x * x).sum())  # measure() keeps its waits: each phase's bytes follow its own kernels
        assert calls.count("synchronize") == 4, calls  # at entry, and at the forward, backward and end marks


def test_available_host_bytes_is_the_free_ram_or_none_where_the_machine_does_not_say(monkeypatch):
    import builtins
    import os

    from memtrain.measure import available_host_bytes

    free = available_host_bytes()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert isinstance(free, int) and 0 < free <= total, (free, total)

    def no_file(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(builtins, "open", no_file)
    assert available_host_bytes() == os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # free pages
    monkeypatch.setattr(os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert available_host_bytes() is None


def _cgroup(folder, files: dict[str, str]):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_available_host_bytes_is_at_most_the_memory_cgroups_limit_less_its_use(tmp_path):
    from memtrain.measure import available_host_bytes, cgroup_room_bytes

    GiB = 2**30
    free = available_host_bytes(str(tmp_path / "none"))  # no cgroup files: the machine's MemAvailable
    membership = tmp_path / "cgroup"
    membership.write_text("0::/\n")
    # cgroup v2: 2 GiB limit, 1.5 GiB used of which 0.5 GiB is reclaimable page cache: 1 GiB of room.
    v2 = tmp_path / "v2"
    _cgroup(v2, {"memory.max": f"{2 * GiB}\n", "memory.current": f"{3 * GiB // 2}\n",
                 "memory.stat": f"anon 1\ninactive_file {GiB // 2}\n"})
    assert cgroup_room_bytes(str(v2), str(membership)) == GiB
    # (MemAvailable moves between calls as other processes allocate: the limit is the figure when it is the less.)
    assert available_host_bytes(str(v2), str(membership)) == GiB or free < 2 * GiB, free
    (v2 / "memory.max").write_text("max\n")  # no limit
    assert cgroup_room_bytes(str(v2), str(membership)) is None
    assert available_host_bytes(str(v2), str(membership)) > GiB or free < 2 * GiB, free
    # cgroup v1, this process in a nested group (as docker writes it): its own limit, the root's "no limit".
    membership.write_text("4:memory:/docker/abc\n1:cpu:/\n")
    v1 = tmp_path / "v1"
    _cgroup(v1 / "memory", {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "5\n"})
    _cgroup(v1 / "memory" / "docker" / "abc", {"memory.limit_in_bytes": f"{GiB}\n",
                                               "memory.usage_in_bytes": f"{GiB // 4}\n",
                                               "memory.stat": "total_inactive_file 0\n"})
    assert cgroup_room_bytes(str(v1), str(membership)) == 3 * GiB // 4
    assert available_host_bytes(str(v1), str(membership)) == 3 * GiB // 4 or free < 2 * GiB, free
