"""The CUDA caching allocator's settings: expandable segments, unless the user chose the allocator's settings.

What runs out on a GPU is reserved memory, not allocated memory: the caching allocator keeps freed blocks in
segments of the sizes first asked for, and a later request of another size may find no free block large enough
while the free bytes would hold it. With ``expandable_segments:True`` a segment grows by mapping more pages, so
freed memory is reused across sizes (torchtune#1185: an 8B QLoRA's peak reserved fell from 16.39 to 10.83 GiB).

The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF`` from torch 2.9) when CUDA starts, so
``configure_allocator`` sets it before that: ``memtrain train`` first of all, ``train()`` where CUDA has not
started yet. A value the user set is kept as it is. ``allocator_reason`` says, in a run's reasons, which it was.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch 2.9 reads the second too
EXPANDABLE = "expandable_segments:True"
# Set beside the variable when memtrain set it: a process started from this one (a notebook's `!memtrain train`, a
# benchmark's runs) inherits both, and says the setting is memtrain's, not the user's.
SET_BY_MEMTRAIN = "MEMTRAIN_SET_ALLOC_CONF"


def read_names(version: str = torch.__version__) -> tuple[str, ...]:
    """The variables the installed torch reads: ``PYTORCH_ALLOC_CONF`` only from torch 2.9 (before, a value there
    is no setting of the allocator's)."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    return ENV_NAMES if (major, minor) >= (2, 9) else ENV_NAMES[:1]


def expandable_segments(environ: MutableMapping[str, str] | None = None, *, default: bool = False) -> bool:
    """Whether the allocator's settings (the variables the installed torch reads) ask for expandable segments;
    ``default`` where neither is set (torch's: False; a memtrain run's on CUDA: True, ``configure_allocator``)."""
    environ = os.environ if environ is None else environ
    given = [environ[name] for name in read_names() if name in environ]
    if not given:
        return default
    return any("expandable_segments:true" in value.replace(" ", "").lower() for value in given)


_decision: str | None = None  # the first decision of this process: the allocator has one set of settings


def configure_allocator(device: torch.device | str | None = None, environ: MutableMapping[str, str] | None = None
                        ) -> str:
    """Sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` where the user set neither variable and CUDA has
    not started; returns what was decided, once per process (later calls return the first decision).

    ``device``: the run's (a device that is not CUDA's needs nothing: "no cuda"); None: this machine's, asked
    before anything starts CUDA (``memtrain train``).

    Returns:
        "memtrain" (set here), "user" (the user's kept), "started" (CUDA had started before: too late to set it)
        or "no cuda" (no CUDA device: nothing to set).
    """
    global _decision
    environ = os.environ if environ is None else environ
    if device is not None and torch.device(device).type != "cuda":
        return "no cuda"
    if _decision is not None and _decision != "no cuda":
        return _decision
    if any(name in environ for name in read_names()):
        _decision = "memtrain" if environ.get(SET_BY_MEMTRAIN) == environ.get(ENV_NAMES[0]) == EXPANDABLE else "user"
    elif not torch.cuda.is_available():
        _decision = "no cuda"
    elif torch.cuda.is_initialized():
        _decision = "started"
    else:
        environ[ENV_NAMES[0]] = environ[SET_BY_MEMTRAIN] = EXPANDABLE
        _decision = "memtrain"
    return _decision


def allocator_reason(device: torch.device | str | None = None, environ: MutableMapping[str, str] | None = None
                     ) -> str | None:
    """The run's reason line for the allocator's settings (None where ``device`` is not CUDA's, or without CUDA):
    expandable segments set by memtrain, the user's own settings kept, or the defaults because CUDA started
    first."""
    environ = os.environ if environ is None else environ
    decision = configure_allocator(device, environ)
    if decision == "no cuda":
        return None
    if decision == "memtrain":
        return (f"allocator: expandable segments ({ENV_NAMES[0]}={EXPANDABLE}, set by memtrain before CUDA "
                "started): freed memory is reused across sizes, so fragmentation does not end the run before its "
                f"budget; set {ENV_NAMES[0]} yourself to choose other settings")
    if decision == "user":
        given = ", ".join(f"{name}={environ[name]!r}" for name in read_names() if name in environ)
        return f"allocator: {given}, as you set it (memtrain sets {EXPANDABLE} only where it is unset)"
    return (f"allocator: CUDA's defaults, without expandable segments: CUDA had started before memtrain could set "
            f"them. To use them, set {ENV_NAMES[0]}={EXPANDABLE} before your script first uses CUDA (memtrain "
            "train sets it itself)")
