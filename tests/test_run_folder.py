"""The run folder: ownership (marker, foreign files), the lock (held in this process, by a killed run, without
flock, by another process), and the temporaries of dead writers cleaned by the lock holder."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import CODE_TEXT, code_windows, quick_run_config, tiny_gpt

from memtrain import ConfigError, train
from memtrain.models import GPT
from memtrain.run import LOCK, MARKER, RunCheckpoints, RunFolder

ROOT = Path(__file__).resolve().parent.parent



def _model() -> GPT:
    return tiny_gpt(seq_len=32, seed=0)



def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _two_checkpoints(root: Path) -> RunCheckpoints:
    checkpoints = RunCheckpoints(root, keep=3)
    checkpoints.save(1, {"w": torch.ones(3), "scheduler": {"last_epoch": 1}})
    checkpoints.save(2, {"w": torch.full((3,), 2.0), "scheduler": {"last_epoch": 2}})
    return checkpoints


# -- ownership ---------------------------------------------------------------------------------------------
def test_a_folder_with_foreign_files_is_refused_and_they_are_never_replaced(tmp_path):
    """A Hugging Face folder passed as out_dir: its config.json is not memtrain's, even with overwrite."""
    out = tmp_path / "hf-model"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="holds config.json, which memtrain did not write") as info:
            train(_model(), code_windows(), quick_run_config(out, overwrite=overwrite))
        assert "never replaces files it did not write" in str(info.value)
    assert _snapshot(out) == before, "a refused run must leave the folder exactly as it was"


def test_overwrite_writes_beside_foreign_files_and_removes_only_memtrains(tmp_path):
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a memtrain run folder"):
        train(_model(), code_windows(), quick_run_config(out))
    train(_model(), code_windows(), quick_run_config(out, overwrite=True))
    assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
    (out / "later.txt").write_text("added to the run folder by its user")
    (out / "checkpoints" / "mine.txt").write_text("also mine")
    first = (out / "model.safetensors").read_bytes()
    train(_model(), code_windows(), quick_run_config(out, overwrite=True, seed=3))
    assert (out / "model.safetensors").read_bytes() != first
    assert (out / "notes.txt").read_text() == "mine" and (out / "later.txt").is_file()
    # checkpoints/ is memtrain's folder: overwrite replaces it whole.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001"]


def test_a_run_of_a_newer_format_is_refused(tmp_path):
    out = tmp_path / "future"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"format": 99}))
    with pytest.raises(ConfigError, match="newer memtrain"):
        train(_model(), code_windows(), quick_run_config(out, overwrite=True))


# -- the lock ----------------------------------------------------------------------------------------------
def test_a_locked_folder_is_refused_naming_its_holder(tmp_path):
    out = tmp_path / "locked"
    with RunFolder(out):  # another run holds it (flock conflicts between open files, in one process too)
        with pytest.raises(ConfigError, match="in use by another run") as info:
            train(_model(), code_windows(), quick_run_config(out))
        assert f"pid {os.getpid()} on host {socket.gethostname()}, since " in str(info.value)
    assert not (out / "metrics.jsonl").exists()
    train(_model(), code_windows(), quick_run_config(out))  # released: the next run takes it
    assert json.loads((out / LOCK).read_bytes() or b"{}") == {}, "a finished run leaves no holder behind"


def test_a_lock_left_by_a_killed_run_is_taken_over_and_said(tmp_path, capsys):
    out = tmp_path / "killed"
    out.mkdir()
    dead = {"pid": _dead_pid(), "host": socket.gethostname(), "since": "2025-01-01 00:00:00 +0000"}
    (out / LOCK).write_text(json.dumps(dead))  # its process died: the kernel dropped the flock, the record stays
    train(_model(), code_windows(), quick_run_config(out))
    assert f"pid {dead['pid']}" in capsys.readouterr().err and (out / "model.safetensors").exists()


def test_without_flock_the_pid_file_detects_live_and_stale_holders(tmp_path, monkeypatch, capsys):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "nfs"
    out.mkdir()
    live = {"pid": os.getppid(), "host": socket.gethostname(), "since": "now"}
    (out / LOCK).write_text(json.dumps(live))
    with pytest.raises(ConfigError, match=f"in use by another run: pid {os.getppid()}"):
        train(_model(), code_windows(), quick_run_config(out))
    (out / LOCK).write_text(json.dumps({**live, "pid": _dead_pid()}))
    train(_model(), code_windows(), quick_run_config(out))
    assert "removed the stale lock" in capsys.readouterr().err


def test_a_failed_set_up_removes_the_lock_and_folder_it_created(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(ConfigError, match="fsdp=True needs several processes"):
        train(_model(), code_windows(), quick_run_config(out, fsdp=True))
    assert not out.exists()


def test_temporaries_of_dead_writers_are_cleaned_by_the_lock_holder(tmp_path):
    out = tmp_path / "run"
    folder = RunFolder(out).lock()
    folder.commit()
    folder.release()
    checkpoints = _two_checkpoints(out)
    (checkpoints.root / ".step-0000003.x1y2.tmp").mkdir()  # kill -9 while assembling step 3
    (checkpoints.root / ".step-0000003.x1y2.tmp" / "meta.json").write_text("{}")
    os.replace(checkpoints.root / "step-0000002", checkpoints.root / ".step-0000002.old")  # killed mid-swap
    (out / ".metrics.jsonl.abc123.tmp").write_text("half")
    (out / ".mine.tmp").write_text("not memtrain's")
    folder = RunFolder(out, resume=True).lock()
    try:
        assert folder.notes == [
            "removed 2 temporaries of a writer that died mid-write: .metrics.jsonl.abc123.tmp, "
            "checkpoints/.step-0000003.x1y2.tmp",
            "put back checkpoints/step-0000002: a writer died between the two renames that replace it"], folder.notes
    finally:
        folder.release()
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["step-0000001", "step-0000002"]
    assert not (out / ".metrics.jsonl.abc123.tmp").exists() and (out / ".mine.tmp").exists()


# -- a lock held by another process ------------------------------------------------------------------------
def test_a_second_process_is_refused_while_the_first_holds_the_folder(tmp_path):
    from memtrain.cli import main

    out = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom memtrain.run import RunFolder\n"
         f"folder = RunFolder({str(out)!r}).lock(); folder.commit()\nprint('locked', flush=True)\ntime.sleep(120)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        text = tmp_path / "t.txt"
        text.write_bytes(CODE_TEXT)
        argv = ["train", "--model", "gpt-tiny", "--seq-len", "32", "--max-steps", "1", "--micro-batch-size", "2",
                "--no-progress", "--data", str(text), "--out", str(out)]
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(argv) == 2
        assert f"in use by another run: pid {holder.pid} on host {socket.gethostname()}" in err.getvalue()
        assert "--out" in err.getvalue() and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the kernel drops a killed process's flock at once
        try:
            RunFolder(out).lock().release()
            break
        except ConfigError:
            time.sleep(0.1)
    else:
        pytest.fail("the lock of a killed process was never released")
