"""A time limit for every GPU test (the tests under ``tests/gpu`` only): a lease of the device machine is minutes long, and one hung test (a deadlocked
stream wait, a compile that never ends) must not eat it. pytest-timeout is not installed there, so the limit is
here: ``MEMTRAIN_GPU_TEST_TIMEOUT`` seconds per test (default 120; ``@pytest.mark.time_limit(s)`` for one test).

Tests marked ``slow`` (the estimate sweep's half-billion-parameter models, inductor compiles) are left out of
``benchmarks/gpu_check.sh quick`` (``-m "not slow"``) and run in its ``tests`` stage. The files in ``LAST`` run
after the others. A test past its limit gets ``GPUTestTimeout`` raised in it (SIGALRM: it fails, and the next test runs). A test
stuck inside one C call (a CUDA synchronisation) cannot take a Python exception; 30 s later faulthandler prints
every thread's stack and ends the process, so the log says where it hung.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

DEFAULT_S = 120.0
# Run last: the files that build the largest models. A run cut at its step's limit then loses the fewest tests.
LAST = ("test_estimate_gpu.py",)
GRACE_S = 30.0  # after the limit, before the hard stop for a test that cannot be interrupted


class GPUTestTimeout(Exception):
    pass


def pytest_addoption(parser: pytest.Parser) -> None:
    # Read where tests/gpu is what pytest was given (an initial conftest), as benchmarks/gpu_check.sh runs it.
    parser.addoption("--out", default=None, help="the JSON file test_allocator_gpu.py writes its figures to")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "time_limit(seconds): this test's limit instead of MEMTRAIN_GPU_TEST_TIMEOUT")


HERE = Path(__file__).resolve().parent


def is_gpu_test(item: pytest.Item) -> bool:
    """Whether ``item`` lives under ``tests/gpu``. pytest calls a conftest's hooks for every test of the session,
    not only for those below it: the limit must not reach the CPU suite, where a slow machine would meet it."""
    return HERE in Path(item.path).resolve().parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # stable: the order within each group is kept; only GPU tests move
    items.sort(key=lambda item: is_gpu_test(item) and item.path.name in LAST)


def limit_for(item: pytest.Item) -> float:
    marker = item.get_closest_marker("time_limit")
    if marker is not None:
        return float(marker.args[0])
    return float(os.environ.get("MEMTRAIN_GPU_TEST_TIMEOUT", DEFAULT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Set-up, call and teardown of one test under its limit (fixtures that build models count too)."""
    limit = limit_for(item) if is_gpu_test(item) else 0.0
    if limit <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise GPUTestTimeout(f"{item.nodeid} ran past its {limit:.0f} s limit (MEMTRAIN_GPU_TEST_TIMEOUT or "
                             "@pytest.mark.time_limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    faulthandler.dump_traceback_later(limit + GRACE_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
