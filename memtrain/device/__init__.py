"""The device seam: every stream, event, asynchronous copy, pinned allocation, memory statistic and placement of
memtrain goes through the ``Accelerator`` that ``accelerator(device)`` returns, so that one code path serves CUDA,
ROCm and XPU builds, the plain CPU (no streams) and the simulated accelerator the tests run on.

``MEMTRAIN_SIMULATED_DEVICE=<capacity>`` (e.g. ``192MiB``) makes any memtrain command plan, estimate and train as on
an accelerator of that capacity, computing on the CPU (``memtrain.device.simulated`` says what it models and what it
cannot see); ``MEMTRAIN_SIMULATED_LAG`` sets how far its streams run behind (an integer, or ``none``: until waited;
default 1). Tests use ``simulate(capacity, lag=...)``.

Example:
    >>> with simulate("64MiB", lag=None) as acc:
    ...     side = acc.new_stream()
    ...     x = acc.place(torch.ones(4))
    ...     host = acc.to_host(x, stream=side)  # NaN until waited
    ...     acc.synchronize_event(acc.record_event(side))
    >>> host.tolist()
    [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from memtrain.device.base import Accelerator
from memtrain.device.real import RealAccelerator, StreamlessAccelerator
from memtrain.device.simulated import SimulatedAccelerator
from memtrain.errors import ConfigError

__all__ = ["Accelerator", "RealAccelerator", "SimulatedAccelerator", "accelerator", "active_simulation",
           "default_device", "simulate"]

ENV = "MEMTRAIN_SIMULATED_DEVICE"
LAG_ENV = "MEMTRAIN_SIMULATED_LAG"

_CPU = Accelerator()
_REAL: dict[torch.device, RealAccelerator] = {}
_ACTIVE: SimulatedAccelerator | None = None
_LOCK = threading.Lock()


def active_simulation() -> SimulatedAccelerator | None:
    """The simulated accelerator in use (``simulate()`` or ``MEMTRAIN_SIMULATED_DEVICE``), or None."""
    if _ACTIVE is None and os.environ.get(ENV):
        _start_from_env()
    return _ACTIVE


def default_device() -> torch.device:
    """Where a run trains: the current accelerator device, else the CPU (also under simulation)."""
    if active_simulation() is not None or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator_ = torch.accelerator
    # torch 2.6 names it current_device_idx; 2.7 renamed it.
    index = (accelerator_.current_device_index if hasattr(accelerator_, "current_device_index")
             else accelerator_.current_device_idx)()
    return torch.device(accelerator_.current_accelerator().type, index)


def accelerator(device: torch.device | str | None = None) -> Accelerator:
    """The seam for ``device`` (None: ``default_device()``); the CPU's is the simulated accelerator while one is
    active."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cpu":
        sim = active_simulation()
        return sim if sim is not None else _CPU
    if device.type == "meta":
        return _CPU
    module = torch.get_device_module(device.type)
    if not hasattr(module, "Stream"):  # e.g. Apple's MPS: one queue, no streams to overlap copies on
        return StreamlessAccelerator(device)
    if not module.is_available() or (device.index or 0) >= module.device_count():
        raise ConfigError(f"device {device} does not exist on this machine (torch sees {module.device_count()} "
                          f"{device.type} device(s)). To resolve this error, pick one it has, or run on the CPU.")
    with _LOCK:
        key = torch.device(device.type, device.index if device.index is not None else module.current_device())
        if key not in _REAL:
            _REAL[key] = RealAccelerator(key)
        return _REAL[key]


@contextmanager
def simulate(capacity: int | str, *, lag: int | None = 1, host_capacity: int | str | None = None,
             segments: bool = False) -> Iterator[SimulatedAccelerator]:
    """A simulated accelerator of ``capacity`` bytes for the calling thread's ops, until the block ends.
    ``segments``: its reserved memory is the caching allocator's segments (``memtrain.device.segments``: 2 and 20
    MiB segments, expandable ones where the allocator's settings ask for them), which a capacity of a few MiB does
    not hold; otherwise the allocated bytes and the blocks held by recorded uses, with no fragmentation."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise ConfigError("simulate(): a simulated accelerator is already active. To resolve this error, end the "
                          f"other simulate() block (or unset {ENV}) first.")
    sim = SimulatedAccelerator(_bytes(capacity), lag=lag,
                               host_capacity=_bytes(host_capacity) if host_capacity is not None else None,
                               segments=segments)
    with sim.mode:
        _ACTIVE = sim
        try:
            yield sim
        finally:
            try:
                sim.synchronize()
            finally:
                _ACTIVE = None


def _bytes(size: int | str) -> int:
    from memtrain.report import parse_bytes  # lazy: report imports the planner, which imports this package

    return size if isinstance(size, int) else parse_bytes(size)


def _start_from_env() -> None:
    """Starts the simulation ``MEMTRAIN_SIMULATED_DEVICE`` asks for, for the rest of the process."""
    global _ACTIVE
    text = os.environ[ENV]
    lag_text = os.environ.get(LAG_ENV, "1").strip().lower()
    try:
        lag = None if lag_text in ("none", "unbounded") else int(lag_text)
    except ValueError:
        raise ConfigError(f"{LAG_ENV}={lag_text!r} is not a lag. To resolve this error, set it to an integer >= 0 "
                          "or 'none'.") from None
    try:
        capacity = _bytes(text)
    except ConfigError as error:
        raise ConfigError(f"{ENV}={text!r}: {error}") from None
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(f"{ENV} is set, but the simulated device was first asked for on thread "
                          f"{threading.current_thread().name}: its ledger counts the ops of the thread that starts "
                          "it. To resolve this error, import memtrain on the main thread first.")
    sim = SimulatedAccelerator(capacity, lag=lag)
    sim.mode.__enter__()  # NOTE: never left: the process runs on the simulated device to its end
    _ACTIVE = sim
