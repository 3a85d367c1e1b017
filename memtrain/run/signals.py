"""Stopping on a signal, within seconds even inside a long step.

The first SIGTERM / SIGINT asks for a stop after the current step (agreed on by every rank, with a checkpoint). A
second one, or the first when the step in progress is predicted to take longer than ``STOP_WAIT_S`` (one process
only), abandons the step itself: ``StopNow`` is raised in the training thread at the next point where Python runs
(between operations in forward, at each parameter's gradient in backward, at each micro-batch) and the loop saves
the last completed step. A step can also sit inside one long C call (an attention over 100,000 tokens takes minutes
on a CPU) where no Python runs: a watchdog thread, woken by the signal itself (``signal.set_wakeup_fd``), then
ends the process after ``ABORT_GRACE_S`` with the signal's exit code, saying which checkpoint is the last.

On several ranks a step cannot be abandoned and saved by one rank alone (its peers wait for it inside the step's
collectives), so there the second signal ends the rank's process at once, without a new checkpoint; torchrun then
stops the other ranks (its answer to a failed worker), and a gloo peer's collective fails as the connection closes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from memtrain.device import accelerator
from memtrain.run.checkpoints import CHECKPOINT_PREFIX, RunCheckpoints

# A first signal waits for the step in progress only when that step is predicted to end within this many seconds;
# a longer step is abandoned at once (the last completed step is saved), so that a stop takes seconds, not minutes.
STOP_WAIT_S = 20.0
# An abandon the training thread has not taken up within this many seconds (it is inside one long C call): the
# watchdog ends the process. Checkpoints are written atomically, so an exit at any moment leaves the last intact.
ABORT_GRACE_S = 5.0
_STOPPING = (signal.SIGTERM, signal.SIGINT)


class StopNow(BaseException):  # noqa: N818  (a stop, not an error)
    """Raised in the training thread to abandon the step in progress. A BaseException, as KeyboardInterrupt is, so
    that no ``except Exception`` on its way (torch.compile's, a library's) swallows it."""

    def __init__(self, signal_name: str, why: str):
        super().__init__(f"{signal_name} {why}")
        self.signal_name = signal_name


def exit_code(signal_name: str) -> int:
    """The shell's code for a process a signal ended: 128 + the signal's number (130 SIGINT, 143 SIGTERM)."""
    return 128 + signal.Signals[signal_name].value


class StopSignals:
    """Turns SIGTERM / SIGINT into a stop: after the current step (with a checkpoint), or within seconds.

    Args:
        distributed: several ranks train together: a first signal never abandons a step (every rank must stop
            after the same one) and a second ends this rank's process.
        checkpoints: the run's checkpoints (None: no run folder), for what is on disk and how to continue.
        model: its trainable parameters get a check in backward (``watch_backward``).
        plan: the run's plan (None: none), whose ``step_seconds`` predicts the first step; each later step is
            predicted to take as long as the one before.
        predicted_seconds: the first step's predicted time, without a plan.

    The loop marks each step (``step``), calls ``check`` between micro-batches, and agrees on a stop after each
    step (``agree``); once it stops, only a further signal ends the process at once.
    """

    def __init__(self, *, distributed: bool = False, checkpoints: RunCheckpoints | None = None,
                 model: torch.nn.Module | None = None, plan: Any = None, predicted_seconds: float | None = None) -> None:
        self.received: str | None = None  # the first signal's name
        self.count = 0  # signals the handler has run for
        self.distributed = distributed
        self.predicted_seconds = plan.step_seconds if plan is not None else predicted_seconds
        self._checkpoints, self._model = checkpoints, model
        out = checkpoints.root.parent if checkpoints is not None else None
        self.resume_text = f"memtrain train --out {out} --resume (resume=True in Python)"
        self._step: int | None = None  # the step in progress (counted from 1), while its micro-batches run
        self._draws: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the RNG at the step's start
        self._device = torch.device("cpu")
        self._long = False  # the step in progress is predicted to take more than STOP_WAIT_S
        self._timed = 0  # steps this session timed (the next step's prediction is the last one's time)
        self._urgent: str | None = None  # why the step in progress must be abandoned (set by either thread)
        self._seen = 0  # signals the watchdog has seen (it sees them while the training thread is inside C)
        self._stopping = threading.Event()  # the loop has taken up the stop: the watchdog stands down
        self._handled_at_stop = 0  # signals the handler had run for then: the watchdog may see them only later
        self._previous: dict[int, Any] = {}
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._hooks: list[Any] = []

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            return self
        for sig in _STOPPING:
            self._previous[sig] = signal.signal(sig, self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the C handler writes without waiting
        try:
            self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter: the handler alone
            reader.close()
            writer.close()
            return self
        self._sockets = reader, writer
        threading.Thread(target=self._watch, args=(reader,), name="memtrain-stop-watchdog", daemon=True).start()
        if self._model is not None:
            self.watch_backward(self._model)
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._sockets is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self.stopping()  # the watchdog must not act on a signal the handler has run for already
            for end in self._sockets:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)  # the watchdog's recv returns: it ends
                end.close()
            self._sockets = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    # -- the training thread's side ----------------------------------------------------------------------------
    def watch_backward(self, model: torch.nn.Module) -> None:
        """A check at each trainable parameter's gradient: backward runs in C++, where the handler cannot run."""
        for p in model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _: self.check()))

    @property
    def last_saved(self) -> int | None:
        """The newest step with a checkpoint on disk (None: none, or no run folder)."""
        paths = self._checkpoints.paths() if self._checkpoints is not None else []
        return int(paths[0].name.removeprefix(CHECKPOINT_PREFIX)) if paths else None

    @contextlib.contextmanager
    def step(self, number: int, device: torch.device) -> Iterator[None]:
        """Marks step ``number`` (counted from 1) as in progress: a stop may abandon it while inside. Keeps the
        random generators' state at its start (``restore_draws``) and its time (the next step's prediction)."""
        predicted = self.predicted_seconds
        self._long = predicted is not None and predicted > STOP_WAIT_S and not self.distributed
        acc = accelerator(device)
        self._draws = torch.get_rng_state(), acc.get_rng_state()
        self._device = device
        self._step = number
        began = time.monotonic()
        try:
            if self.received is not None and self._long:  # a stop was asked for before this long step began
                self._urgent = self._urgent or f"received before a step predicted to take over {STOP_WAIT_S:.0f} s"
            self.check()
            yield
            took, self._timed = time.monotonic() - began, self._timed + 1
            # The session's first step also warms up (compiles, allocates): it predicts no more than the plan did.
            first = self._timed == 1 and self.predicted_seconds is not None
            self.predicted_seconds = min(took, self.predicted_seconds) if first else took
        finally:
            self._step = None

    def restore_draws(self) -> None:
        """The random generators as the abandoned step found them: the checkpoint of the step before it must hold
        the draws an uninterrupted run makes from there (dropout masks)."""
        if self._draws is not None:
            torch.set_rng_state(self._draws[0])
            if self._draws[1] is not None:
                accelerator(self._device).set_rng_state(self._draws[1])

    def agree(self, device: torch.device) -> str | None:
        """After a step: the signal any rank received (``agree_on_stop``); when there is one, the loop saves and
        stops now, so the watchdog stands down."""
        agreed = agree_on_stop(self.received, device)
        if agreed:
            self.stopping()
        return agreed

    def abandoned(self, stop: StopNow, step: int, began: bool) -> str:
        """The line for a step abandoned by ``stop``: what is on disk and how to continue."""
        saved = ("it had begun updating parameters (an optimizer step had started), so nothing new was saved; "
                 if began else "")
        return f"{stop}: stopped during step {step}, which is discarded; {saved}{self._how_to_continue()}"

    def _how_to_continue(self) -> str:
        if self._checkpoints is None:
            return "the run has no folder (no out_dir), so nothing was saved"
        if self.last_saved is None:
            return ("no checkpoint was written yet, so nothing can be resumed: start the run again with --overwrite "
                    "(overwrite=True in Python)")
        return f"the last checkpoint is step {self.last_saved}; continue with: {self.resume_text}"

    def check(self) -> None:
        """Raises ``StopNow`` when the step in progress is to be abandoned (any thread: backward's hooks run on
        the device's threads)."""
        if self._urgent is not None and self._step is not None and not self._stopping.is_set():
            why, self._urgent = self._urgent, None
            raise StopNow(self.received or "SIGTERM", why)

    def stopping(self) -> None:
        """The loop has taken up the stop (it saves and returns): the watchdog stands down, unless a further
        signal comes (the handler has run for every signal so far: this runs in the training thread)."""
        self._handled_at_stop = self.count
        self._stopping.set()

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        self.received = self.received or name
        if self.count > 1 and self.distributed:
            self._exit(name, "received again on this rank")
        why = self._why(self.count)
        if why is not None:
            self._urgent = self._urgent or why
            self.check()  # inside the step: raised right here, between two operations

    def _why(self, count: int) -> str | None:
        if count > 1:
            return "received again"
        if self._long and self._step is not None:
            return f"received during a step predicted to take over {STOP_WAIT_S:.0f} s"
        return None

    # -- the watchdog's side -----------------------------------------------------------------------------------
    def _watch(self, reader: socket.socket) -> None:
        """Sees each signal as it arrives (the C handler writes its number to the wakeup socket, even while the
        training thread is inside one long C call) and ends the process when an abandon is not taken up."""
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number not in (s.value for s in _STOPPING):
                    continue
                self._seen += 1
                name = signal.Signals(number).name
                if self._stopping.is_set() and self._step is None and self._seen > self._handled_at_stop:
                    self._exit(name, "received again while the run was saving and stopping")
                if self._seen > 1 and self.distributed:
                    self._exit(name, "received again on this rank")
                why = self._why(self._seen)
                if why is not None and not self._stopping.is_set():
                    self._urgent = self._urgent or why
                    threading.Thread(target=self._expire, args=(name, self._seen), daemon=True).start()

    def _expire(self, name: str, seen: int) -> None:
        deadline = time.monotonic() + ABORT_GRACE_S
        while time.monotonic() < deadline:
            if self._stopping.is_set() or self._seen != seen:  # taken up, or a later signal's own timer runs
                return
            time.sleep(0.05)
        self._exit(name, f"received, and the step in progress did not reach a point where it can stop within "
                         f"{ABORT_GRACE_S:.0f} s (it is inside one long operation)")

    def _exit(self, name: str, why: str) -> None:
        """Ends the process now with the signal's exit code, after one line saying what is on disk."""
        step = f"step {self._step}" if self._step is not None else "the run"
        rank = f"rank {dist.get_rank()}: " if dist.is_available() and dist.is_initialized() else ""
        with contextlib.suppress(Exception):
            sys.stderr.write(f"memtrain: {rank}{name} {why}: {step} stopped at once, nothing of it saved; "
                             f"{self._how_to_continue()}\n")
            sys.stderr.flush()
        os._exit(exit_code(name))


def agree_on_stop(received: str | None, device: torch.device) -> str | None:
    """The signal any rank received, on every rank (None on all when none did), so that all stop after the same
    step: a rank that stopped alone would wait in the checkpoint's collectives while the others wait in the next
    step's. One all-reduce of one number per step, only under torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return received
    on = device if "nccl" in dist.get_backend() else torch.device("cpu")
    code = torch.tensor([signal.Signals[received].value if received else 0], device=on)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    value = int(code.item())
    return signal.Signals(value).name if value else None
