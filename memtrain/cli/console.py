"""What the command writes and how it exits: the exit codes, and output that survives a reader closing stdout
early (``memtrain plan | head -1``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2
EXIT_ENVIRONMENT = 1  # one line, no trace: the machine, not memtrain, failed
# A run stopped by a signal after its checkpoint is not a success (`memtrain train ... && upload` must not upload):
# the shell's code for a process a signal ended, 128 + the signal's number.
EXIT_STOPPED = {"SIGINT": 130, "SIGTERM": 143}
EXIT_CODES_HELP = ("exit codes: 0 success; 2 bad input (one message naming the fix); 1 an environment fault (a full "
                   "disk, a read-only filesystem) or an internal failure; 130 / 143 a run stopped by SIGINT / SIGTERM "
                   "after its checkpoint (continue it with --resume)")

_STDOUT_CLOSED = False  # set when a reader closed stdout early (e.g. `| head -1`); main() exits 1 saying so


def echo(message: str, *, file: Any = None) -> None:
    """print(), except that a stdout closed by its reader drops the rest of the output instead of raising."""
    file = file or sys.stdout
    if _STDOUT_CLOSED and file is sys.stdout:
        return
    try:
        print(message, file=file, flush=True)
    except BrokenPipeError:
        if file is not sys.stdout:
            raise
        close_stdout()


def close_stdout() -> None:
    """Records that stdout's reader went away (main() exits 1 saying so) and drops the rest of the output."""
    global _STDOUT_CLOSED
    _STDOUT_CLOSED = True
    _drop_stdout()


def stdout_closed() -> bool:
    """Whether a reader closed stdout early since the last ``reset_stdout()``."""
    return _STDOUT_CLOSED


def reset_stdout() -> None:
    """Forgets a closed stdout of an earlier main() call in this process (tests call main() many times)."""
    global _STDOUT_CLOSED
    _STDOUT_CLOSED = False


def _drop_stdout() -> None:
    """Points stdout at /dev/null: Python would otherwise fail again flushing it at exit."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if sys.stdout is sys.__stdout__:
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull.fileno(), sys.stdout.fileno())
            return
    sys.stdout = devnull


def log(args: argparse.Namespace, message: str) -> None:
    # With --json, stdout carries only the JSON document.
    echo(message, file=sys.stderr if args.json else sys.stdout)


@contextlib.contextmanager
def third_party_progress(*, enabled: bool) -> Iterator[None]:
    """With ``enabled=False`` (--no-progress), transformers' and huggingface_hub's own progress bars ("Loading
    weights", "Writing model shards", downloads) are off inside, as memtrain's are; each library's setting comes
    back after. Libraries that are not installed are left alone (and not imported)."""
    restore = []
    if not enabled:
        if importlib.util.find_spec("transformers") is not None:
            from transformers.utils import logging as transformers_logging

            if transformers_logging.is_progress_bar_enabled():
                transformers_logging.disable_progress_bar()
                restore.append(transformers_logging.enable_progress_bar)
        if importlib.util.find_spec("huggingface_hub") is not None:
            from huggingface_hub import utils as hub_utils

            if not hub_utils.are_progress_bars_disabled():
                hub_utils.disable_progress_bars()
                restore.append(hub_utils.enable_progress_bars)
    try:
        yield
    finally:
        for undo in restore:
            undo()


@contextlib.contextmanager
def progress_lines(logger: str, *, enabled: bool) -> Iterator[None]:
    """The library logger's progress lines (``memtrain.planner.progress``: a plan's slow stages) on stderr inside,
    one a line; nothing with ``enabled=False`` (--json, --no-progress)."""
    if not enabled:
        yield
        return
    log_ = logging.getLogger(logger)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = log_.level, log_.propagate
    log_.addHandler(handler)
    log_.setLevel(logging.INFO)
    log_.propagate = False  # once, here: not again through a root handler an application set up
    try:
        yield
    finally:
        log_.removeHandler(handler)
        log_.setLevel(level)
        log_.propagate = propagate
