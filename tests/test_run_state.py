"""The state of a run: a checkpoint whose state does not load is skipped for the previous one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain import MemtrainError
from memtrain.run import RunCheckpoints, resume_run


def _two_checkpoints(root: Path) -> RunCheckpoints:
    checkpoints = RunCheckpoints(root, keep=3)
    checkpoints.save(1, {"w": torch.ones(3), "scheduler": {"last_epoch": 1}})
    checkpoints.save(2, {"w": torch.full((3,), 2.0), "scheduler": {"last_epoch": 2}})
    return checkpoints


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
