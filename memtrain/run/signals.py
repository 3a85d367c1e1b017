"""Stopping on a signal: SIGTERM / SIGINT ask for a stop after the current step, agreed on by every rank."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist


class StopSignals:
    """Turns SIGTERM / SIGINT into a request to stop after the current step (with a checkpoint)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def agree_on_stop(received: str | None, device: torch.device) -> str | None:
    """The signal any rank received, on every rank (None on all when none did), so that all stop after the same
    step: a rank that stopped alone would wait in the checkpoint's collectives while the others wait in the next
    step's. One all-reduce of one number per step, only under torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return received
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    code = torch.tensor([signal.Signals[received].value if received else 0], device=on)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    value = int(code.item())
    return signal.Signals(value).name if value else None


