"""Every stream, event, asynchronous copy, pinned allocation, memory statistic and device generator goes through
the device seam (memtrain/device): code elsewhere that called CUDA itself would take the CPU's path on the simulated
accelerator, and its CUDA path would never run in the tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "memtrain"
SEAM = ROOT / "device"
# What only the seam may call. torch.cuda's queries of the machine (is_available, device_count, get_device_name,
# get_device_capability, is_bf16_supported) stay where they are: they ask what exists, they move nothing.
# A copy to the host with non_blocking=True is one too (its result is garbage until an event is waited); one to
# the device from pageable memory is staged by the runtime, and stays.
FORBIDDEN = re.compile(
    r"torch\.cuda\.(Stream|Event)\b"
    r"|torch\.cuda\.(stream|current_stream|synchronize|memory_allocated|max_memory_allocated|max_memory_reserved|"
    r"memory_reserved|memory_stats|reset_peak_memory_stats|mem_get_info|empty_cache|get_rng_state|set_rng_state|"
    r"cudart)\("
    r"|(?<!acc)\.record_stream\(|\.pin_memory\(\)|pin_memory\s*=\s*(True|pin\b)"
    r"|\.to\([\"']cpu[\"'][^)]*non_blocking\s*=\s*True"
    r"|device\.type\s*==\s*[\"']cuda[\"']")
# Where a match is not a device operation (a DataLoader flag, the estimator's model of CUDA, a message).
ALLOWED = {
    "data/loader.py",  # DataLoader(pin_memory=...): the loader's own flag, resolved for the device
    "estimate/cuda.py",  # CUDA's rules applied on the CPU's kernels, no CUDA call
    # "cuda" as the planner's target name (plan(device="cuda"), under a simulation the simulated device) and the
    # probe's matrix sizes: nothing there decides a stream or moves a tensor (probe() asks the seam).
    "planner/devices.py",
}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _offending_lines() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if SEAM in path.parents or rel in ALLOWED:
            continue
        text = path.read_text()
        prose = _docstring_lines(ast.parse(text))
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if number not in prose and FORBIDDEN.search(code):
                found.append(f"memtrain/{rel}:{number}: {line.strip()}")
    return found


def test_only_the_device_seam_calls_streams_events_pinned_memory_and_the_allocator():
    assert _offending_lines() == []
