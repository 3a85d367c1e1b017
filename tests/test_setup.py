"""The test set-up itself: `make test` installs the versions the suite was last proven on, and no test fails for
being slow outside tests/gpu (a hung test is shown by pytest's own faulthandler instead)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_make_installs_through_the_lock_and_it_pins_every_requirement_but_torch():
    makefile = (ROOT / "Makefile").read_text()
    installs = [line for line in makefile.splitlines() if "install --quiet" in line and "-e " in line]
    assert len(installs) == 2 and all("-c $(LOCK)" in line for line in installs), installs
    assert re.search(r"^LOCK\s*\?=\s*constraints\.txt$", makefile, re.MULTILINE)
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            pinned[name.lower().replace("_", "-")] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_requirement_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted |= {_requirement_name(r) for r in extra}
    missing = sorted(wanted - {"torch"} - set(pinned))
    assert not missing, f"constraints.txt pins no version of {missing}: run `make lock` after `make test` passed"
    assert "torch" not in pinned  # the Makefile's $(TORCH) decides it (a CUDA build may be asked for)


def test_the_gpu_time_limit_stays_in_tests_gpu(tmp_path):
    """tests/gpu/conftest.py's per-test limit once applied to every test of the session (pytest calls a conftest's
    hooks for all of them): a slow machine failed CPU tests at 120 s. Here the limit is 1 s and a CPU test sleeps
    for 2 s beside the GPU folder's tests: it must pass."""
    slow = tmp_path / "test_slow_cpu.py"
    slow.write_text("import time\n\ndef test_slow():\n    time.sleep(2)\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
         str(ROOT / "tests" / "gpu" / "conftest.py"), str(slow)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "MEMTRAIN_GPU_TEST_TIMEOUT": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout, result.stdout[-2000:]


def test_pytest_shows_a_hung_test_with_its_faulthandler_not_a_time_limit():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert int(options["faulthandler_timeout"]) >= 600
