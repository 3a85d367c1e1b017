"""Issue 28: ``benchmarks/gpu_check.sh quick`` covers every path and fits one lease. Its dry run adds up to at most
480 s and 8 result files and names the new coverage (parameter offload, pure bf16, the delayed update with bf16
weights over micro-batches, ``memtrain train``, QLoRA); benchmarks/gpu_paths.py, which runs those cases on the
device, imports and parses ``--help`` here, and its logic that only matters on a GPU (the whole-process peak across
the loop's resets, the verdicts, the run folder's figures, the deadline, the skip without bitsandbytes) is
exercised on the CPU. No GPU figure is asserted: none is measurable here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
LEASE_S = 480
RESULT_FILES = 8
NEW_CASES = ("param-offload", "pure-bf16", "delayed-bf16-accumulation", "memtrain-train", "qlora")


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(BENCHMARKS))  # gpu_paths imports gpu_plan and gpu_offload_weights by name
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def paths():
    return _load("gpu_paths")


def _dry_run(stage: str, tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    run = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh"), "--dry-run", stage], capture_output=True,
                         text=True, timeout=60, cwd=BENCHMARKS.parent, env={**env, "OUT": str(tmp_path / "out")})
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()


def _steps(lines: list[str]) -> dict[str, str]:
    return {m[1]: m[2] for m in (re.fullmatch(r"step (\S+) limit \d+s writes \S+: (.*)", line) for line in lines)
            if m}


def test_quick_fits_one_lease_and_names_the_new_coverage(tmp_path, paths):
    lines = _dry_run("quick", tmp_path)
    total = int(re.fullmatch(r"total (\d+)s", lines[-1])[1])
    files = int(re.fullmatch(r"files (\d+): .*", lines[-2])[1])
    assert total <= LEASE_S, f"quick's limits add to {total} s, over the {LEASE_S} s of a lease"
    assert files <= RESULT_FILES, f"quick writes {files} result files, {RESULT_FILES} come back"
    steps = _steps(lines)
    command = steps["paths"]
    cases = re.search(r"--cases (\S+)", command)[1].split(",")
    assert cases == list(paths.CASES) and set(NEW_CASES) <= set(cases), cases
    assert "benchmarks/gpu_paths.py" in command and "--deadline" in command, command
    # The tests that run in quick leave the slow ones to the tests stage; each has a limit.
    assert "-m not slow" in steps["tests-gpu"] and "MEMTRAIN_GPU_TEST_TIMEOUT=" in steps["tests-gpu"]
    # What quick no longer plans runs in the plan stage.
    plan = _steps(_dry_run("plan", tmp_path))["plan"]
    budgets = re.search(r"--budgets (\S+)", plan)[1].split(",")
    assert {"8GiB", "24GiB+compile", "24GiB", "8GiB+compile"} <= set(budgets), budgets


def test_each_case_has_a_limit_and_a_function(paths):
    assert set(paths.CASES) == set(paths.CASE_LIMIT_S) == set(paths.CASE_FUNCTIONS)
    assert paths.BUDGETS["param-offload"][0] == "4GiB"  # issue 28: the 1.1B inside 4 GiB
    # memtrain train's budget is below its model's fp32 weights: a run that first puts them all on the device fails.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in paths.TRAIN_LLAMA.items() if k != "architectures"})
    with __import__("torch").device("meta"):
        n = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    budget = paths.parse_bytes(paths.BUDGETS["memtrain-train"][0])
    assert 4 * n > budget > 2 * n, (4 * n, budget)


@pytest.mark.parametrize("script", ["gpu_paths.py", "gpu_offload_weights.py"])
def test_the_scripts_parse_help(script):
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=BENCHMARKS.parent)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr


def test_the_peak_tracker_keeps_the_maximum_across_resets(paths, monkeypatch):
    torch = pytest.importorskip("torch")
    after_reset = iter([(300, 900)])  # the peaks of the step that follows the first reset; none after the second
    current = [(700, 800)]  # the set-up's peaks (the model moved to the device), before the loop's first reset
    resets = []

    def fake_reset(device=None):
        resets.append(device)
        current[0] = next(after_reset, (0, 0))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: current[0][0])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: current[0][1])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake_reset)
    monkeypatch.setattr(torch.cuda.memory, "reset_peak_memory_stats", fake_reset)
    with paths.PeakTracker().installed() as peaks:
        torch.cuda.reset_peak_memory_stats("cuda:0")  # the loop's reset before its step: 700 must not be lost
        torch.cuda.memory.reset_peak_memory_stats()
    assert (peaks.allocated, peaks.reserved) == (700, 900) and resets == ["cuda:0", None]
    assert torch.cuda.reset_peak_memory_stats is fake_reset, "the wrapper must be removed"


def test_verdicts(paths):
    gow = _load("gpu_offload_weights")
    row = {"run_peak_allocated_bytes": 3 << 30, "run_peak_reserved_bytes": 5 << 30, "alloc_retries": 0}
    checks = gow.budget_checks(row, 4 << 30)
    assert checks == {"allocated <= budget": True, "reserved <= budget": False, "num_alloc_retries == 0": True}
    assert gow.verdict(checks) is False and gow.verdict(dict.fromkeys(checks, None)) is None
    assert gow.verdict(gow.budget_checks({**row, "run_peak_reserved_bytes": 4 << 30}, 4 << 30)) is True
    assert gow.verdict(gow.budget_checks({**row, "alloc_retries": 2}, 8 << 30)) is False
    assert paths.finish({}, {"a": True, "b": None})["status"] == "ran"
    assert paths.finish({"error": "boom"}, {"a": False})["status"] == "FAIL"
    assert paths.finish({"error": "boom"}, {"a": None})["status"] == "error"
    assert paths.finish({}, {"a": True})["status"] == "pass"
    assert paths.losses_fall([10.4, 10.4, 10.1]) and not paths.losses_fall([10.4, float("nan"), 10.1])


def test_run_folder_figures_read_the_largest_step_peak_and_the_report(paths, tmp_path):
    steps = [{"step": i, "loss": 9.0 - i, "peak_bytes": p, "tokens_per_s": 1000.0 * i} for i, p in
             enumerate([900, 700, 650], 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (tmp_path / "report.json").write_text(json.dumps({"measurement": {"peak_bytes": 700}, "prediction": {
        "settings": {"optimizer": "offload-bf16-weights"}, "peak_bytes": 680}}))
    got = paths.run_folder_figures(tmp_path)
    assert got["metrics_peak_bytes"] == 900 and got["report_peak_bytes"] == 700, got
    assert got["tokens_per_s"] == 2500.0 and got["losses"] == [8.0, 7.0, 6.0], got
    assert got["plan"]["optimizer"] == "offload-bf16-weights" and got["predicted_peak_bytes"] == 680
    assert paths.run_folder_figures(tmp_path / "missing") == {}


def test_qlora_is_skipped_with_a_reason_without_bitsandbytes(paths, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    why = paths.skip_reason("qlora")
    assert why.startswith("skipped: bitsandbytes is not importable") and "gpu_check.sh" in why
    assert paths.skip_reason("param-offload") is None


def test_a_deadline_skips_and_records_every_case(paths, tmp_path, capsys):
    out = tmp_path / "paths.json"
    assert paths.main(["--small", "--deadline", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["rows"]] == list(paths.CASES)
    assert all(r["status"] == "skipped" for r in doc["rows"]), doc["rows"]
    assert "skipped" in capsys.readouterr().out


def test_the_delayed_case_trains_on_the_cpu(paths):
    """The delayed update lands a step late: the second step's loss is the first's (same weights, same batch)."""
    row = paths.run_case_here("delayed-bf16-accumulation", small=True)
    assert row["status"] == "ran" and not row.get("error"), row
    losses = row["losses"]
    assert len(losses) == 4 and losses[1] == pytest.approx(losses[0]) and losses[-1] < losses[0], losses
    assert row["plan"]["accumulation"] == 2 and row["plan"]["delayed_update"] is True
