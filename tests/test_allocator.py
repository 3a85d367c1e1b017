"""The CUDA allocator's settings: expandable segments set before CUDA starts, unless the user set the allocator's
variable (kept as it is, and said), or CUDA had started (said, with the fix). No CUDA here: torch's two queries
are stood in for, and the environment is a dict or monkeypatched."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from memtrain.cli import main
from memtrain.device import allocator
from memtrain.device.allocator import EXPANDABLE, allocator_reason, configure_allocator


@pytest.fixture
def cuda(monkeypatch):
    """A process with CUDA available and not started (``started`` flips the second), no decision made yet."""
    state = {"started": False}
    monkeypatch.setattr(allocator, "_decision", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["started"])
    return state


def test_expandable_segments_are_set_where_the_user_set_nothing(cuda):
    environ: dict[str, str] = {}
    assert configure_allocator(environ=environ) == "memtrain"
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE, "MEMTRAIN_SET_ALLOC_CONF": EXPANDABLE}
    reason = allocator_reason(environ=environ)
    assert reason.startswith("allocator: expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                             "set by memtrain before CUDA started)"), reason
    # One decision per process: the allocator has one set of settings.
    assert configure_allocator(environ={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}) == "memtrain"
    # A run on another device needs nothing, and says nothing.
    assert configure_allocator("cpu") == "no cuda" and allocator_reason("cpu") is None
    assert allocator_reason("cuda:0", environ=environ) == reason


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("value", ["max_split_size_mb:128", "expandable_segments:False", ""])
def test_the_users_settings_are_kept_and_said(cuda, name, value):
    environ = {name: value}
    assert configure_allocator(environ=environ) == "user" and environ == {name: value}
    assert allocator_reason(environ=environ) == (f"allocator: {name}={value!r}, as you set it (memtrain sets "
                                         "expandable_segments:True only where it is unset)")


def test_a_process_started_from_a_memtrain_run_says_the_setting_is_memtrains(cuda, monkeypatch):
    """A child inherits the variable and the mark beside it: memtrain's, not the user's; a value the user changed
    since is the user's."""
    inherited = {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE, "MEMTRAIN_SET_ALLOC_CONF": EXPANDABLE}
    assert configure_allocator(environ=dict(inherited)) == "memtrain"
    monkeypatch.setattr(allocator, "_decision", None)
    assert configure_allocator(environ={**inherited, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}) == "user"


def test_torch_before_2_9_reads_only_the_cuda_variable(cuda, monkeypatch):
    """``PYTORCH_ALLOC_CONF`` is the allocator's from torch 2.9: before, a value there sets nothing, so memtrain
    sets its own (it never says an ignored value is in force)."""
    assert allocator.read_names("2.8.0+cu126") == ("PYTORCH_CUDA_ALLOC_CONF",)
    assert allocator.read_names("2.9.0") == allocator.read_names("2.13.0+cpu") == allocator.ENV_NAMES
    monkeypatch.setattr(allocator, "read_names", lambda: ("PYTORCH_CUDA_ALLOC_CONF",))
    environ = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert configure_allocator(environ=environ) == "memtrain" and environ["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE


def test_cuda_started_first_is_said_with_the_fix(cuda):
    cuda["started"] = True
    environ: dict[str, str] = {}
    assert configure_allocator(environ=environ) == "started" and environ == {}
    reason = allocator_reason(environ=environ)
    assert "CUDA had started before memtrain could set them" in reason, reason
    assert "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before your script first uses CUDA" in reason


def test_without_cuda_nothing_is_set_or_said(monkeypatch):
    monkeypatch.setattr(allocator, "_decision", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    environ: dict[str, str] = {}
    assert configure_allocator(environ=environ) == "no cuda" and allocator_reason(environ=environ) is None and environ == {}


def test_memtrain_train_sets_it_before_joining_the_group(cuda, monkeypatch, tmp_path, capsys):
    """Joining the torchrun group sets the device (CUDA starts): the variable must be set before it."""
    import memtrain.cli.train as cli_train

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "MEMTRAIN_SET_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # recorded, so that what the run sets is undone after the test
        monkeypatch.delenv(name)
    seen = []
    group = cli_train.distributed_group

    @contextlib.contextmanager
    def watched():
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the run itself on this machine's CPU
        with group() as joined:
            yield joined

    monkeypatch.setattr(cli_train, "distributed_group", watched)
    argv = ["train", "--model", "gpt-tiny", "--max-steps", "1", "--micro-batch-size", "4", "--no-progress",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 0, capsys.readouterr().err
    assert seen == [EXPANDABLE]


def test_a_run_reports_the_reserved_peak_beside_the_allocated_one(tmp_path):
    """metrics.jsonl and the result carry the allocator's reserved peak (what runs out: its cache included) beside
    the allocated one, on an accelerator (the simulated one here); neither on the CPU."""
    import json

    from helpers import code_windows, quick_run_config, tiny_gpt

    from memtrain import train
    from memtrain.device import simulate

    with simulate("64MiB"):
        result = train(tiny_gpt(2, seq_len=32, seed=0), code_windows(32),
                       quick_run_config(tmp_path / "sim", max_steps=2, global_batch_size=4))
    lines = [json.loads(line) for line in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["peak_bytes"] <= m["peak_reserved_bytes"] <= 64 * 2**20 for m in lines), lines
    assert result.peak_reserved_bytes == lines[-1]["peak_reserved_bytes"] > 0
    cpu = train(tiny_gpt(2, seq_len=32, seed=0), code_windows(32),
                quick_run_config(tmp_path / "cpu", max_steps=1, global_batch_size=4))
    line = json.loads((tmp_path / "cpu" / "metrics.jsonl").read_text())
    assert cpu.peak_reserved_bytes is None and line["peak_reserved_bytes"] is None and line["peak_bytes"] is None
