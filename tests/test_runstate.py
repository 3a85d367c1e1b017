"""The run folder: ownership (marker, foreign files), the lock, checksummed checkpoints that fall back when
damaged, the append-only metrics log, and write faults that name the file and the intact checkpoint."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from memtrain import ConfigError, MemtrainError, TrainConfig, train
from memtrain.data import split_windows
from memtrain.models import GPT, GPTConfig
from memtrain.runstate import (
    LOCK,
    MARKER,
    SUMS,
    MetricsLog,
    RunCheckpoints,
    RunFolder,
    RunWriteError,
    resume_run,
)

ROOT = Path(__file__).resolve().parent.parent
TEXT = (b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300)


def _data():
    import numpy as np

    return split_windows(np.frombuffer(TEXT, dtype=np.uint8).copy(), 32)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=32, n_layer=2, n_head=2, n_embd=32))


def _config(out: Path, **changes) -> TrainConfig:
    fields = {"max_steps": 1, "micro_batch_size": 2, "out_dir": str(out), "progress": False, "sample_bytes": 0,
              "lr": 1e-2, "eval_batches": 1}
    return TrainConfig(**{**fields, **changes})


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


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
            train(_model(), _data(), _config(out, overwrite=overwrite))
        assert "never replaces files it did not write" in str(info.value)
    assert _snapshot(out) == before, "a refused run must leave the folder exactly as it was"


def test_overwrite_writes_beside_foreign_files_and_removes_only_memtrains(tmp_path):
    out = tmp_path / "mixed"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a memtrain run folder"):
        train(_model(), _data(), _config(out))
    train(_model(), _data(), _config(out, overwrite=True))
    assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
    (out / "later.txt").write_text("added to the run folder by its user")
    (out / "checkpoints" / "mine.txt").write_text("also mine")
    first = (out / "model.safetensors").read_bytes()
    train(_model(), _data(), _config(out, overwrite=True, seed=3))
    assert (out / "model.safetensors").read_bytes() != first
    assert (out / "notes.txt").read_text() == "mine" and (out / "later.txt").is_file()
    # checkpoints/ is memtrain's folder: overwrite replaces it whole.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000001"]


def test_a_run_of_a_newer_format_is_refused(tmp_path):
    out = tmp_path / "future"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"format": 99}))
    with pytest.raises(ConfigError, match="newer memtrain"):
        train(_model(), _data(), _config(out, overwrite=True))


# -- the lock ----------------------------------------------------------------------------------------------
def test_a_locked_folder_is_refused_naming_its_holder(tmp_path):
    out = tmp_path / "locked"
    with RunFolder(out):  # another run holds it (flock conflicts between open files, in one process too)
        with pytest.raises(ConfigError, match="in use by another run") as info:
            train(_model(), _data(), _config(out))
        assert f"pid {os.getpid()} on host {socket.gethostname()}, since " in str(info.value)
    assert not (out / "metrics.jsonl").exists()
    train(_model(), _data(), _config(out))  # released: the next run takes it
    assert json.loads((out / LOCK).read_bytes() or b"{}") == {}, "a finished run leaves no holder behind"


def test_a_lock_left_by_a_killed_run_is_taken_over_and_said(tmp_path, capsys):
    out = tmp_path / "killed"
    out.mkdir()
    dead = {"pid": _dead_pid(), "host": socket.gethostname(), "since": "2025-01-01 00:00:00 +0000"}
    (out / LOCK).write_text(json.dumps(dead))  # its process died: the kernel dropped the flock, the record stays
    train(_model(), _data(), _config(out))
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
        train(_model(), _data(), _config(out))
    (out / LOCK).write_text(json.dumps({**live, "pid": _dead_pid()}))
    train(_model(), _data(), _config(out))
    assert "removed the stale lock" in capsys.readouterr().err


def test_a_failed_set_up_removes_the_lock_and_folder_it_created(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(ConfigError, match="fsdp=True needs several processes"):
        train(_model(), _data(), _config(out, fsdp=True))
    assert not out.exists()


# -- checkpoints -------------------------------------------------------------------------------------------
def _two_checkpoints(root: Path) -> RunCheckpoints:
    checkpoints = RunCheckpoints(root, keep=3)
    checkpoints.save(1, {"w": torch.ones(3), "scheduler": {"last_epoch": 1}})
    checkpoints.save(2, {"w": torch.full((3,), 2.0), "scheduler": {"last_epoch": 2}})
    return checkpoints


def _rewrite_sums(path: Path) -> None:
    """As a buggy writer would: contents wrong but checksums matching them."""
    import hashlib

    lines = [f"{hashlib.sha256((path / n).read_bytes()).hexdigest()}  {n}\n" for n in ("meta.json", "tensors.safetensors")]
    (path / SUMS).write_text("".join(lines))


def test_an_edited_meta_json_is_damage_and_the_previous_checkpoint_is_used(tmp_path):
    checkpoints = _two_checkpoints(tmp_path)
    newest = checkpoints.paths()[0]
    meta = json.loads((newest / "meta.json").read_text())
    meta["state"]["scheduler"]["last_epoch"] = 7  # valid JSON, another LR schedule
    (newest / "meta.json").write_text(json.dumps(meta))
    step, state, skipped = checkpoints.load_latest()
    assert step == 1 and state["w"].tolist() == [1.0, 1.0, 1.0]
    assert skipped == ["step-0000002: meta.json does not match its checksum (edited, truncated or corrupt)"]


@pytest.mark.parametrize("damage", ["wrong meta", "bad header", "no sums", "meta not a dict"])
def test_every_unreadable_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    checkpoints = _two_checkpoints(tmp_path)
    newest = checkpoints.paths()[0]
    if damage == "wrong meta":
        (newest / "meta.json").write_text(json.dumps({"step": 2}))
        _rewrite_sums(newest)
    elif damage == "meta not a dict":
        (newest / "meta.json").write_text("[1, 2]")
        _rewrite_sums(newest)
    elif damage == "bad header":  # a safetensors header edited to a shape its bytes do not hold
        data = (newest / "tensors.safetensors").read_bytes()
        (newest / "tensors.safetensors").write_bytes(data.replace(b"[3]", b"[9]"))
        _rewrite_sums(newest)
    else:
        (newest / SUMS).unlink()
    step, _, skipped = checkpoints.load_latest()
    assert step == 1 and len(skipped) == 1 and skipped[0].startswith("step-0000002: "), skipped


def test_a_checkpoint_whose_state_does_not_load_is_skipped(tmp_path):
    checkpoints = _two_checkpoints(tmp_path)
    tried = []

    def restore(step, state):
        tried.append(step)
        if step == 2:
            raise KeyError("optimizer")

    step, _, skipped = resume_run(checkpoints, {}, restore)
    assert step == 1 and tried == [2, 1] and "its state does not load (KeyError" in skipped[0]
    with pytest.raises(MemtrainError, match="no checkpoint in .* can be resumed"):
        resume_run(checkpoints, {}, lambda step, state: (_ for _ in ()).throw(ValueError("nope")))


def test_foreign_names_under_checkpoints_are_ignored_and_kept(tmp_path):
    checkpoints = _two_checkpoints(tmp_path)
    (checkpoints.root / "step-abc").mkdir()
    (checkpoints.root / "step-5").write_text("a file, not a checkpoint")
    (checkpoints.root / "README").write_text("mine")
    assert [p.name for p in checkpoints.paths()] == ["step-0000002", "step-0000001"]
    checkpoints.save(3, {"w": torch.zeros(1)})
    checkpoints.save(4, {"w": torch.zeros(1)})  # prunes to keep=3, never touching foreign names
    names = sorted(p.name for p in checkpoints.root.iterdir())
    assert names == ["README", "step-0000002", "step-0000003", "step-0000004", "step-5", "step-abc"], names


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


def test_a_failed_checkpoint_write_names_the_file_and_the_intact_checkpoint(tmp_path, monkeypatch):
    checkpoints = RunCheckpoints(tmp_path)
    checkpoints.save(1, {"w": torch.ones(2)})
    import safetensors.torch

    def full_disk(tensors, filename):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(RunWriteError) as info:
        checkpoints.save(2, {"w": torch.zeros(2)})
    message = str(info.value)
    assert "tensors.safetensors (No space left on device)" in message
    assert f"the last good checkpoint, {checkpoints.paths()[0]}, is intact" in message
    assert [p.name for p in checkpoints.root.iterdir()] == ["step-0000001"], "no temporary left behind"


# -- the metrics log ---------------------------------------------------------------------------------------
def test_metrics_are_appended_one_line_per_step_never_rewritten(tmp_path, monkeypatch):
    renamed = []
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        renamed.append(Path(dst).name)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    out = tmp_path / "appended"
    train(_model(), _data(), _config(out, max_steps=4, save_every=2))
    assert "metrics.jsonl" not in renamed, renamed  # rewritten whole, a 100k-step run would be quadratic
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def _log_with(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def test_resume_cuts_the_log_to_the_checkpoint_and_survives_a_damaged_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in range(1, 6)]
    _log_with(path, [*good, b'{"step": 6, "lo'])  # killed mid-line
    kept, notes = MetricsLog(path).start(resume_step=3)
    assert [m["step"] for m in kept] == [1, 2, 3] and "dropped 3 line(s) after step 3" in notes[0]
    assert path.read_bytes() == b"".join(good[:3])
    _log_with(path, [*good[:4], b'{"step": 5, "lo'])
    kept, notes = MetricsLog(path).start(resume_step=5)
    assert [m["step"] for m in kept] == [1, 2, 3, 4]
    assert "line 5 is damaged" in notes[0] and "the metrics of steps 5-5 are lost" in notes[0], notes
    _log_with(path, [good[0], b"\x00\x00garbage\n", good[2]])
    kept, notes = MetricsLog(path).start(resume_step=3)
    assert [m["step"] for m in kept] == [1] and "steps 2-3 are lost" in notes[0]
    log = MetricsLog(path)
    log.start(resume_step=1)
    log.append({"step": 2})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_resumed_run_with_a_damaged_metrics_line_continues_from_its_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    train(_model(), _data(), _config(out, max_steps=3, save_every=2))
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-0000003")  # the run died after logging step 3, before its checkpoint
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 4, "loss"')
    result = train(_model(), _data(), _config(out, max_steps=4, resume=True))
    assert result.resumed_from == 2 and result.steps == 4
    assert "dropped 2 line(s) after step 2" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


# -- a lock held by another process ------------------------------------------------------------------------
def test_a_second_process_is_refused_while_the_first_holds_the_folder(tmp_path):
    from memtrain.cli import main

    out = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom memtrain.runstate import RunFolder\n"
         f"folder = RunFolder({str(out)!r}).lock(); folder.commit()\nprint('locked', flush=True)\ntime.sleep(120)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        text = tmp_path / "t.txt"
        text.write_bytes(TEXT)
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


# -- the data fingerprint ----------------------------------------------------------------------------------
def _datasets_of_each_kind():
    """Pairs (a, b) of datasets of the same length whose contents differ in one item's one field."""
    from memtrain.data import Document, PackedRow

    def packed(flip: int):
        rows = [PackedRow(torch.arange(8), torch.arange(1, 9), torch.arange(8)) for _ in range(3)]
        labels = rows[1].labels.clone()
        labels[3] = flip
        rows[1] = rows[1]._replace(labels=labels)
        return rows

    def docs(last: int):
        return [Document(torch.tensor([1, 2, 3]), torch.tensor([-100, 2, last])) for _ in range(2)]

    return {
        "PackedRow": (packed(-100), packed(7)),
        "Document": (docs(3), docs(4)),
        "tuples of lists": ([([1, 2, 3], [2, 3, 4])] * 2, [([1, 2, 3], [2, 3, 5]), ([1, 2, 3], [2, 3, 4])]),
        "lists of ints": ([[1, 2], [3, 4]], [[1, 2], [3, 5]]),
        "strings": (["def f(): pass", "x = 1"], ["def f(): pass", "x = 2"]),
        "dicts": ([{"input_ids": [1, 2]}], [{"input_ids": [1, 3]}]),
        "dtype only": ([torch.zeros(4, dtype=torch.int32)], [torch.zeros(4, dtype=torch.float32)]),
        "shape only": ([torch.zeros(2, 3)], [torch.zeros(3, 2)]),
        "numpy": ([np.arange(4)], [np.arange(4) * 2]),
    }


@pytest.mark.parametrize("kind", list(_datasets_of_each_kind()))
def test_data_of_the_same_length_and_other_contents_fingerprint_differently(kind):
    from memtrain.runstate import data_fingerprint

    a, b = _datasets_of_each_kind()[kind]
    assert len(a) == len(b)
    fa, fb = data_fingerprint(a), data_fingerprint(b)
    assert fa["examples"] == fb["examples"]
    assert fa["sha256"] != fb["sha256"], f"{kind}: two datasets with other contents fingerprint alike: {fa}"
    again = _datasets_of_each_kind()[kind][0]  # equal contents, other objects
    assert data_fingerprint(again) == fa, f"{kind}: equal contents must fingerprint alike"


def test_every_example_of_a_list_counts_not_a_sample():
    from memtrain.runstate import data_fingerprint

    a = [torch.tensor([i]) for i in range(1000)]
    b = list(a)
    b[1] = torch.tensor([-1])  # not among 256 evenly spaced samples of 1000
    assert data_fingerprint(a)["sha256"] != data_fingerprint(b)["sha256"]
    assert data_fingerprint(a)["of"] == "every example"


def test_the_fingerprint_takes_bf16_empty_and_zero_d_tensors_and_the_packing_of_rows():
    from memtrain.data import PackedRows, TokenDocuments
    from memtrain.runstate import data_fingerprint

    items = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 0), torch.tensor(3.0), np.zeros(()), None, 1.5]
    assert data_fingerprint(items)["sha256"] != data_fingerprint(items[:-1] + [2.5])["sha256"]
    docs = TokenDocuments.from_texts(["abcd", "xyz", "pq"])
    masked = TokenDocuments(docs.tokens, docs.starts, docs.lengths, loss_mask=np.arange(len(docs.tokens)) % 2 == 0)
    assert data_fingerprint(docs)["sha256"] != data_fingerprint(masked)["sha256"], "the loss mask is data"
    rows, other = PackedRows(docs, seq_len=4), PackedRows(docs, seq_len=4, pad_id=7)
    assert len(rows) == len(other) and data_fingerprint(rows)["of"] == "token stream"
    assert data_fingerprint(rows)["sha256"] != data_fingerprint(other)["sha256"], "the padding is data"
    assert data_fingerprint(rows) == data_fingerprint(PackedRows(docs, seq_len=4))


# -- pruning counts intact checkpoints only -----------------------------------------------------------------
def _damage(path: Path) -> None:
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the tensors: fails its checksum
    (path / "tensors.safetensors").write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_does_not_push_the_last_good_one_out(tmp_path):
    checkpoints = RunCheckpoints(tmp_path, keep=2)
    checkpoints.save(1, {"w": torch.ones(3)})
    checkpoints.save(2, {"w": torch.full((3,), 2.0)})
    _damage(checkpoints.paths()[0])
    checkpoints.save(3, {"w": torch.full((3,), 3.0)})
    names = [p.name for p in checkpoints.paths()]
    assert names == ["step-0000003", "step-0000002", "step-0000001"], (
        f"keep=2 must keep two intact checkpoints (3 and 1) beside the damaged 2: {names}")
    checkpoints.save(4, {"w": torch.full((3,), 4.0)})  # now 4 and 3 are the two intact: 2 and 1 go
    assert [p.name for p in checkpoints.paths()] == ["step-0000004", "step-0000003"]


def test_a_damaged_checkpoint_of_a_later_step_never_removes_the_one_just_written(tmp_path):
    """A resume from step 4 past a damaged step 6, saving step 5 with keep=1: step 5 is the only good one."""
    checkpoints = RunCheckpoints(tmp_path, keep=1)
    checkpoints.save(4, {"w": torch.ones(3)})
    checkpoints.keep = 2
    checkpoints.save(6, {"w": torch.full((3,), 6.0)})
    checkpoints.keep = 1
    _damage(checkpoints.paths()[0])
    step, _, skipped = checkpoints.load_latest()
    assert step == 4 and len(skipped) == 1
    checkpoints.save(5, {"w": torch.full((3,), 5.0)})
    assert [p.name for p in checkpoints.paths()] == ["step-0000006", "step-0000005"]
    step, state, skipped = checkpoints.load_latest()
    assert step == 5 and state["w"].tolist() == [5.0, 5.0, 5.0], (step, skipped)


def test_pruning_hashes_each_kept_checkpoint_once_not_at_every_save(tmp_path, monkeypatch):
    import memtrain.runstate as runstate

    checkpoints = RunCheckpoints(tmp_path, keep=3)
    hashed = []
    real = runstate.sha256_file
    monkeypatch.setattr(runstate, "sha256_file", lambda path: hashed.append(path.parent.name) or real(path))
    for step in range(1, 6):
        checkpoints.save(step, {"w": torch.full((3,), float(step))})
    verified = [name for name in hashed if name.startswith("step-")]
    assert verified == [], f"the checkpoints this process wrote are known intact; hashed again: {verified}"
    fresh = RunCheckpoints(tmp_path, keep=3)  # a resumed process: hashes each kept one once
    fresh.save(6, {"w": torch.zeros(3)})
    fresh.save(7, {"w": torch.zeros(3)})
    verified = [name for name in hashed if name.startswith("step-")]
    assert sorted(verified) == ["step-0000004"] * 2 + ["step-0000005"] * 2, verified
