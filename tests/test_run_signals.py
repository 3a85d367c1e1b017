"""A signal stops a run within seconds even inside a long step: a second SIGTERM abandons the step in progress (the
last completed step saved, `--resume` continuing bit for bit), a step stuck in one long operation ends the process
after the grace, and a first signal abandons a step predicted to take long.

The slow step is made by a runner that wraps the loss of one micro-batch in a function whose backward sleeps for
ten minutes (so a run that did not stop would fail the test by its time-out, not by a timed assertion)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memtrain.run import StopNow, StopSignals
from memtrain.run.signals import STOP_WAIT_S

ROOT = Path(__file__).resolve().parent.parent
TEXT = (b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300)
SLOW_STEP = 3  # steps 1 and 2 are ordinary; step 3's first backward sleeps
MICRO, GLOBAL = 2, 4  # two micro-batches a step: step 3's first forward is the 5th
STEPS = 5
STOP_BOUND_S = 60  # generous: a stop takes seconds; the slow step would take ten minutes

RUNNER = """
import dataclasses, importlib, signal, sys, time
import torch
import memtrain.models as models

# Dropout, so that the abandoned step's draws must be given back for the resume to be bit-identical.
models.GPT_PRESETS["gpt-tiny"] = dataclasses.replace(models.GPT_PRESETS["gpt-tiny"], dropout=0.1)

slow_at, mode, mark = int(sys.argv[1]), sys.argv[2], sys.argv[3]
train_module = importlib.import_module("memtrain.run.step")  # the module whose step calls the loss
real_loss = train_module.language_model_loss
forwards = [0]


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss):
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        if mode == "one-long-operation":  # as a C call that runs no Python: the signals wait on this thread
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        open(mark, "w").close()
        time.sleep(600)
        return grad


def loss(model, x, y, position_ids=None, **kwargs):
    forwards[0] += 1
    out = real_loss(model, x, y, position_ids, **kwargs)
    return SlowBackward.apply(out) if forwards[0] == slow_at else out


train_module.language_model_loss = loss
from memtrain.cli import main

sys.exit(main(sys.argv[4:]))
"""


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_bytes(TEXT)
    return path


def _flags(text_file: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--model", "gpt-tiny", "--seq-len", "32", "--data", str(text_file), "--micro-batch-size",
            str(MICRO), "--global-batch-size", str(GLOBAL), "--max-steps", str(STEPS), "--no-progress",
            "--out", str(out), *extra]


def _slow_run(tmp_path: Path, text_file: Path, out: Path, mode: str, *extra: str,
              slow_step: int = SLOW_STEP) -> tuple[subprocess.Popen, Path]:
    runner, mark = tmp_path / "runner.py", tmp_path / "in-slow-backward"
    runner.write_text(RUNNER)
    first_of_slow_step = (slow_step - 1) * (GLOBAL // MICRO) + 1
    proc = subprocess.Popen([sys.executable, str(runner), str(first_of_slow_step), mode, str(mark),
                             *_flags(text_file, out, *extra)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not mark.exists():  # the run is inside step 3's backward
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached its slow step"
        time.sleep(0.05)
    return proc, mark


def _stop_twice(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM, then (the first only asks for a stop after the step, which sleeps ten minutes) a second one;
    returns stdout and stderr."""
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None, "a first signal waits for a step predicted to be short"
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the run did not stop within {STOP_BOUND_S} s of a second SIGTERM")
    return out, err


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith("."))


@pytest.mark.slow
def test_a_second_sigterm_abandons_a_slow_step_saves_the_last_one_and_resume_is_bit_identical(tmp_path, text_file):
    out = tmp_path / "stopped"
    # --save-every 100: no checkpoint before the stop, so the one resumed from is the stop's own.
    proc, _ = _slow_run(tmp_path, text_file, out, "sleep-in-backward", "--save-every", "100")
    _, err = _stop_twice(proc)
    assert proc.returncode == 143, err  # SIGTERM's code, as `memtrain train --help` documents
    assert (f"SIGTERM received again: stopped during step {SLOW_STEP}, which is discarded; the last checkpoint is "
            f"step {SLOW_STEP - 1}; continue with: memtrain train --out {out} --resume") in err, err
    assert "Traceback" not in err, err
    assert _checkpoints(out) == [f"step-{SLOW_STEP - 1:07d}"]  # the completed step, not a half one
    assert _steps(out) == list(range(1, SLOW_STEP))

    # Resumed and straight through the same runner (its GPT has dropout), never slow (forward 0 never comes).
    never = [sys.executable, str(tmp_path / "runner.py"), "0", "none", str(tmp_path / "unused")]
    resumed = subprocess.run([*never, "train", "--out", str(out), "--resume", "--no-progress"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {SLOW_STEP - 1}" in resumed.stderr
    assert _steps(out) == list(range(1, STEPS + 1))
    straight = tmp_path / "straight"
    done = subprocess.run([*never, *_flags(text_file, straight)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    a, b = load_file(out / "model.safetensors"), load_file(straight / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff == 0.0, f"{name}: the resumed run differs from the uninterrupted one by {diff:.3e}"


@pytest.mark.slow
def test_a_second_sigterm_inside_one_long_operation_ends_the_process_and_resume_continues(tmp_path, text_file):
    out = tmp_path / "stuck"
    proc, _ = _slow_run(tmp_path, text_file, out, "one-long-operation", "--save-every", "1")
    _, err = _stop_twice(proc)
    assert proc.returncode == 143, err
    assert (f"SIGTERM received, and the step in progress did not reach a point where it can stop within 5 s (it is "
            f"inside one long operation): step {SLOW_STEP} stopped at once, nothing of it saved; the last checkpoint "
            f"is step {SLOW_STEP - 1}; continue with: memtrain train --out {out} --resume") in err, err
    assert _checkpoints(out)[-1] == f"step-{SLOW_STEP - 1:07d}"  # nothing of step 3
    resumed = subprocess.run([sys.executable, "-m", "memtrain", "train", "--out", str(out), "--resume",
                              "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr  # the lock the ended process left is found stale
    assert f"resumed from step {SLOW_STEP - 1}" in resumed.stderr
    assert _steps(out) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_run_stopped_inside_its_first_step_says_there_is_nothing_to_resume(tmp_path, text_file):
    out = tmp_path / "first"
    proc, _ = _slow_run(tmp_path, text_file, out, "sleep-in-backward", slow_step=1)
    said, err = _stop_twice(proc)
    assert proc.returncode == 143, err
    assert ("SIGTERM received again: stopped during step 1, which is discarded; no checkpoint was written yet, so "
            "nothing can be resumed: start the run again with --overwrite") in err, err
    assert "stopped by SIGTERM before its first step finished: nothing to resume" in said, said
    assert not (out / "checkpoints").exists() or not _checkpoints(out)


def _signalled_step(signals: StopSignals) -> str:
    """A step during which this process receives SIGTERM; "abandoned" or "finished"."""
    try:
        with signals.step(1, torch.device("cpu")):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # Python runs here: the handler runs between two of these
                signals.check()
                time.sleep(0.001)
    except StopNow as stop:
        assert str(stop).startswith("SIGTERM received during a step predicted to take over"), str(stop)
        return "abandoned"
    return "finished"


def test_the_first_signal_abandons_a_step_predicted_long_and_waits_for_a_short_one():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(predicted_seconds=STOP_WAIT_S / 10) as signals:
        assert _signalled_step(signals) == "finished"
        assert signals.received == "SIGTERM" and signals.count == 1
    with StopSignals(predicted_seconds=STOP_WAIT_S * 10) as signals:
        assert _signalled_step(signals) == "abandoned"
        assert signals.received == "SIGTERM"
    # Every rank must stop after the same step: never abandoned on the first signal.
    with StopSignals(distributed=True, predicted_seconds=STOP_WAIT_S * 10) as signals:
        assert _signalled_step(signals) == "finished"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler it replaced is back


def test_a_slow_first_step_does_not_make_the_next_short_step_long(monkeypatch):
    """The session's first step warms up (compiles, allocates): after one of 30 s, a step the plan predicts at 1 s
    is still waited for on a first signal (it was abandoned: the next step's prediction was the first's time)."""
    import memtrain.run.signals as signals_module

    clock = iter([0.0, STOP_WAIT_S * 1.5, 100.0, 100.5])
    monkeypatch.setattr(signals_module.time, "monotonic", lambda: next(clock))
    with StopSignals(predicted_seconds=1.0) as signals:
        with signals.step(1, torch.device("cpu")):
            pass
        assert signals.predicted_seconds == 1.0
        with signals.step(2, torch.device("cpu")):
            pass
        assert signals.predicted_seconds == 0.5  # later steps: the last step's time
