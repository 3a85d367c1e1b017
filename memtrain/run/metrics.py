"""The run's metrics log: one JSON line per optimizer step, appended, cut back to the checkpoint on resume; the
loggers of ``TrainConfig.log`` (TensorBoard) get the same lines."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memtrain.run.tensorboard import TENSORBOARD_FOLDER, TensorBoardLog


class MetricsLog:
    """metrics.jsonl: one JSON line per optimizer step, appended (each step costs one line, whatever the run's
    length), flushed every step, fsynced at every checkpoint; on resume cut back to the checkpoint's step.

    ``log``: where else each line goes (``TrainConfig.log``): "tensorboard" writes event files into the run
    folder's ``tensorboard/`` (a resume appends).
    """

    def __init__(self, path: Path, *, log: tuple[str, ...] = ()):
        self.path = path
        self._file: Any = None
        self.log = log
        self._tensorboard: TensorBoardLog | None = None

    def start(self, *, resume_step: int | None) -> tuple[list[dict[str, Any]], list[str]]:
        """Opens the log for appending. ``resume_step``: the checkpoint's step; lines after it are dropped (those
        steps run again), and a damaged line ends what is kept (the steps after it have no metrics).

        Returns:
            (the lines kept, notes for the log).
        """
        kept: list[dict[str, Any]] = []
        notes: list[str] = []
        if "tensorboard" in self.log:
            self._tensorboard = TensorBoardLog(self.path.parent / TENSORBOARD_FOLDER, resume_step=resume_step)
        if resume_step is None:
            self._file = open(self.path, "w", encoding="utf-8")
            return kept, notes
        if not self.path.exists():
            notes.append(f"metrics.jsonl is missing: the metrics of steps 1-{resume_step} are lost")
        else:
            data = self.path.read_bytes()
            end, damaged, dropped = 0, None, 0
            for number, line in enumerate(data.splitlines(keepends=True), 1):
                if kept and kept[-1]["step"] >= resume_step:
                    dropped += 1
                    continue
                try:
                    if not line.endswith(b"\n"):
                        raise ValueError("cut short")
                    value = json.loads(line)
                    if not isinstance(value, dict) or value.get("step") != len(kept) + 1:
                        raise ValueError(f"step {len(kept) + 1} expected")
                except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                    damaged = f"line {number} is damaged ({str(e)[:80]})"
                    break
                kept.append(value)
                end += len(line)
            if damaged is not None:
                lost = f"; the metrics of steps {len(kept) + 1}-{resume_step} are lost" if len(kept) < resume_step else ""
                notes.append(f"metrics.jsonl: {damaged}: kept the {len(kept)} lines before it{lost}")
            elif dropped:
                notes.append(f"metrics.jsonl: dropped {dropped} line(s) after step {resume_step} (not checkpointed: "
                             "those steps run again)")
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        self._file = open(self.path, "a", encoding="utf-8")
        return kept, notes

    def append(self, line: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()  # in the OS's hands: a killed process loses no step it logged
        if self._tensorboard is not None:
            self._tensorboard.add_line(line)

    def add_text(self, tag: str, lines: list[str]) -> None:
        """``lines`` (e.g. the plan's reasons) as text where the loggers show text (TensorBoard); metrics.jsonl
        holds numbers only."""
        if self._tensorboard is not None:
            self._tensorboard.add_lines(tag, lines)

    def sync(self) -> None:
        """Makes the lines written so far durable (called before each checkpoint: no checkpoint is ahead of them)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


