"""Checksummed checkpoints: damage of every kind falls back to the previous one, foreign names are kept, a
failed write names the file and the intact checkpoint, and pruning counts intact checkpoints only."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

import memtrain.run.checkpoints as checkpoints_module
from memtrain.run import SUMS, RunCheckpoints, RunWriteError


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
    checkpoints = RunCheckpoints(tmp_path, keep=3)
    hashed = []
    real = checkpoints_module.sha256_file
    monkeypatch.setattr(checkpoints_module, "sha256_file", lambda path: hashed.append(path.parent.name) or real(path))
    for step in range(1, 6):
        checkpoints.save(step, {"w": torch.full((3,), float(step))})
    verified = [name for name in hashed if name.startswith("step-")]
    assert verified == [], f"the checkpoints this process wrote are known intact; hashed again: {verified}"
    fresh = RunCheckpoints(tmp_path, keep=3)  # a resumed process: hashes each kept one once
    fresh.save(6, {"w": torch.zeros(3)})
    fresh.save(7, {"w": torch.zeros(3)})
    verified = [name for name in hashed if name.startswith("step-")]
    assert sorted(verified) == ["step-0000004"] * 2 + ["step-0000005"] * 2, verified
