"""TensorBoard event files beside metrics.jsonl (``TrainConfig(log=("tensorboard",))``, ``--log tensorboard``):
per optimizer step the loss, the held-out loss, the learning rate, tokens/s and memory (the allocator's peak, the
bytes saved for backward, the model state, the process's resident host memory), and the plan's reasons as text.
The files go to ``<run>/tensorboard/``; ``tensorboard --logdir <run>/tensorboard`` shows them. The ``tensorboard``
package is an extra (``pip install 'memtrain[tensorboard]'``), checked at start-up, not after training.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memtrain.message import Message, arg

LOGGERS = ("tensorboard",)  # where a run can log beside metrics.jsonl (TrainConfig.log)
TENSORBOARD_FOLDER = "tensorboard"  # <run>/tensorboard/: the event files
MIB = 2**20
# metrics.jsonl's key -> (the TensorBoard tag, the divisor): bytes are shown in MiB.
SCALARS: dict[str, tuple[str, int]] = {
    "loss": ("train/loss", 1), "eval_loss": ("eval/loss", 1), "lr": ("train/lr", 1),
    "tokens_per_s": ("train/tokens_per_s", 1), "grad_norm": ("train/grad_norm", 1),
    "peak_bytes": ("memory/peak_MiB", MIB), "peak_reserved_bytes": ("memory/peak_reserved_MiB", MIB),
    "activation_bytes": ("memory/saved_activations_MiB", MIB),
    "model_state_bytes": ("memory/model_state_MiB", MIB),
}
HOST_TAG = "memory/host_resident_MiB"  # the process's resident host memory when the step was logged
PLAN_TAG = "plan"


def logger_problems(log: Any) -> list[str]:
    """The problems of ``TrainConfig.log`` (empty: none), the missing ``tensorboard`` package among them, so that a
    run fails at start-up rather than after training."""
    if not isinstance(log, tuple) or not all(isinstance(name, str) for name in log):
        return [Message(f"{arg('log', log)} must be a tuple of logger names ({', '.join(LOGGERS)}). To resolve this error, "
                f"pass e.g. {arg('log', ('tensorboard',))}, or {arg('log', ())} for metrics.jsonl only.")]
    problems = [f"{arg('log', name)} is not a logger memtrain has ({', '.join(LOGGERS)}). To resolve this error, "
                "pass one of them." for name in log if name not in LOGGERS]
    if "tensorboard" in log and importlib.util.find_spec("tensorboard") is None:
        problems.append(f"{arg('log', 'tensorboard')} writes TensorBoard event files, and the tensorboard package "
                        "is not installed. To resolve this error, pip install 'memtrain[tensorboard]' (or "
                        f"tensorboard), or drop {arg('log', 'tensorboard')}.")
    return list(map(Message, problems))


def host_resident_bytes() -> int | None:
    """The process's resident host memory now (Linux ``/proc/self/statm``), or None where the system does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class TensorBoardLog:
    """One ``torch.utils.tensorboard.SummaryWriter`` into ``folder``: a scalar per figure of each metrics line
    (global step: the optimizer step, counted from 1), text once per session.

    A resume appends a new event file; the steps after the checkpoint (logged, then run again) are hidden with
    TensorBoard's ``purge_step``, so each step shows once, as in metrics.jsonl.
    """

    def __init__(self, folder: Path, *, resume_step: int | None):
        # Imported here: it needs the tensorboard package (an extra, which logger_problems checks at start-up).
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=resume_step + 1 if resume_step is not None else None)
        self.start_step = resume_step or 0

    def add_line(self, line: Mapping[str, Any]) -> None:
        """The figures of one metrics.jsonl line (None or absent: not measured, not logged), and the host memory."""
        step = line["step"]
        for key, (tag, divisor) in SCALARS.items():
            value = line.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value / divisor, step)
        host = host_resident_bytes()
        if host is not None:
            self.writer.add_scalar(HOST_TAG, host / MIB, step)

    def add_lines(self, tag: str, lines: Sequence[str]) -> None:
        """``lines`` as one text entry at the session's first step (shown as written: a Markdown code block)."""
        self.writer.add_text(tag, "\n".join(f"    {line}" for line in lines), self.start_step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
