"""CPU smoke tests of the GPU scripts benchmarks/gpu_plan.py (issue 11) and benchmarks/gpu_lean_optimizer.py (issue
14): their ``--small`` modes plan, apply and train tiny Llamas end to end on the CPU and write their JSON, and the
logic that only matters on a GPU (budgets as fractions, process isolation and its time limit, the lean run's
fallback, the baseline's next candidate after an out-of-memory) is exercised here. So are benchmarks/gpu_check.sh's
steps, limits and result files (issue 18: ``quick`` fits one lease) and tests/gpu's per-test time limit.

No timing is asserted; the CPU has no allocator peak, so the peaks must be reported as not measured.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from memtrain import ConfigError  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses, and gpu_lean_optimizer's `from gpu_plan import`, look it up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_plan():
    return _load("gpu_plan")


@pytest.fixture(scope="module")
def lean():
    _load("gpu_plan")
    return _load("gpu_lean_optimizer")


def _check_trained(row: dict, vocab: int, steps: int) -> None:
    name = row["budget"] if "budget" in row else row["role"]
    assert row.get("error") is None, f"{name}: {row.get('error')}"
    assert len(row["seconds"]) == steps and row["median_s"] > 0 and row["tokens_per_s"] > 0, row["seconds"]
    losses = row["losses"]
    assert all(math.isfinite(v) for v in losses), f"{name}: losses {losses}"
    # A random Llama predicts about uniformly: the summed loss normalised per token is ln(vocab). A loss divided
    # by the wrong count (micro-batches, sequences) would be far off.
    assert abs(losses[0] - math.log(vocab)) < 0.05 * math.log(vocab), f"{name}: first loss {losses[0]}, ln V " \
        f"{math.log(vocab):.3f}"
    assert losses[-1] < losses[0], f"{name}: training did not lower the loss: {losses}"
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "run_peak_reserved_bytes"):
        assert row[key] is None, f"{name}: {key} {row[key]} on a CPU, where no allocator peak exists"
    assert row["fits"] is None, f"{name}: fits {row['fits']} claimed without a measurement"


def test_gpu_plan_small_plans_applies_and_trains_every_budget(gpu_plan, tmp_path):
    out = tmp_path / "plan.json"
    code = gpu_plan.main(["--small", "--device", "cpu", "--budgets", "0.1x,0.5x,1.11x", "--warmup", "1",
                          "--repeats", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = {r["budget"]: r for r in doc["rows"]}
    assert list(rows) == ["0.1x", "0.5x", "1.11x"], list(rows)
    assert code == 1, "a budget that nothing fits must make the exit status 1"
    assert "no set-up fits" in rows["0.1x"]["error"] and "plan" not in rows["0.1x"], rows["0.1x"]
    reference = gpu_plan.no_savings_peak(gpu_plan.SHAPES["tiny"], 256, 8)
    for text in ("0.5x", "1.11x"):
        row = rows[text]
        assert row["budget_bytes"] == int(float(text[:-1]) * reference), (row["budget_bytes"], reference)
        _check_trained(row, gpu_plan.SHAPES["tiny"].vocab, steps=2)
        assert row["predicted_peak_bytes"] <= row["usable_bytes"] < row["budget_bytes"], row
        s = row["plan"]
        assert s["micro_batch_size"] * s["accumulation"] == 8, s
        assert len(row["losses"]) == 3, row["losses"]
    # The larger budget is the unconstrained one: nothing recomputed, and never predicted slower.
    assert rows["1.11x"]["plan"]["choices"]["checkpointing"] == "none", rows["1.11x"]["plan"]
    assert rows["0.5x"]["plan"]["choices"]["checkpointing"] != "none", rows["0.5x"]["plan"]
    assert rows["1.11x"]["predicted_tokens_per_s"] >= rows["0.5x"]["predicted_tokens_per_s"]
    assert doc["shape"]["parameters"] == sum(p.numel() for p in gpu_plan.meta_llama(gpu_plan.SHAPES["tiny"], 8)
                                             .parameters())


def test_gpu_plan_isolated_budget_runs_in_a_child_process(gpu_plan, tmp_path):
    out = tmp_path / "plan.json"
    code = gpu_plan.main(["--small", "--device", "cpu", "--isolate", "process", "--budgets", "1.11x", "--warmup",
                          "1", "--repeats", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0, doc["rows"]
    (row,) = doc["rows"]
    assert row["budget"] == "1.11x" and row["process_s"] > 0, row
    _check_trained(row, gpu_plan.SHAPES["tiny"].vocab, steps=1)


def test_gpu_plan_deadline_skips_and_records(gpu_plan, tmp_path):
    out = tmp_path / "plan.json"
    code = gpu_plan.main(["--small", "--device", "cpu", "--budgets", "16MiB,24MiB", "--deadline", "1", "--out",
                          str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == 1 and [r["budget"] for r in rows] == ["16MiB", "24MiB"], rows
    assert all(r["error"].startswith("skipped:") for r in rows), rows


def test_gpu_plan_budget_parsing(gpu_plan):
    specs = gpu_plan.parse_budgets("8GiB, 24GiB+compile,0.5x", lambda: 1000)
    assert [(s.budget_bytes, s.compile) for s in specs] == [(8 * 2**30, False), (24 * 2**30, True), (500, False)]
    calls = []
    gpu_plan.parse_budgets("8GiB", lambda: calls.append(1) or 1)
    assert not calls, "the no-savings estimate must only be computed when a fraction is given"
    with pytest.raises(ConfigError) as e:
        gpu_plan.parse_budgets("8GiB,abc,4GiB+fast,-1x", lambda: 1000)
    for bad in ("'abc'", "'4GiB+fast'", "'-1x'"):
        assert bad in str(e.value), str(e.value)


def test_gpu_plan_refuses_a_full_size_cpu_run(gpu_plan):
    with pytest.raises(ConfigError, match="without --small"):
        gpu_plan.parse_args(["--device", "cpu"])


def test_build_llama_in_the_plans_weight_dtype(gpu_plan):
    shape = gpu_plan.SHAPES["tiny"]
    model = gpu_plan.build_llama(shape, 64, "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32, "the rotary frequencies must stay fp32"
    assert torch.get_default_dtype() == torch.float32, "build_llama must restore the default dtype"
    fp32 = gpu_plan.build_llama(shape, 64, "cpu")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == shape.parameters


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie is dead, waiting for a reaper


def test_run_child_kills_a_child_and_its_children_past_its_limit(gpu_plan, tmp_path):
    # torch.compile's workers are the child's children: a time limit must end them too.
    script = tmp_path / "sleeper.py"
    pid_file = tmp_path / "grandchild.pid"
    script.write_text("import pathlib, subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))\n"
                      "time.sleep(60)\n")
    doc, why = gpu_plan.run_child([], 3.0, script=script)
    assert doc is None and "killed after its 3 s limit" in why, why
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), f"the child's own child {grandchild} outlived the time limit"


def test_lean_small_runs_the_lean_plan_and_the_baseline(lean, tmp_path):
    out = tmp_path / "lean.json"
    code = lean.main(["--small", "--device", "cpu", "--warmup", "1", "--repeats", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0, doc["rows"]
    lean_row, base = doc["rows"]
    assert lean_row["role"] == "lean" and base["role"] == "baseline"
    _check_trained(lean_row, lean.SHAPES["tiny"].vocab, steps=2)
    _check_trained(base, lean.SHAPES["tiny"].vocab, steps=2)
    assert lean_row["predicted_peak_bytes"] <= lean_row["usable_bytes"], lean_row
    assert lean_row["master"].startswith("fp32"), lean_row["master"]
    assert lean_row["moments"] in ("fp32", "bf16", "int8"), lean_row["moments"]
    # The pretend device holds the smaller shape only: the larger was estimated, found too big, and skipped.
    assert base["shape"] == "tiny" and all(not e["fits"] for e in base["estimates"] if e["shape"] == "tiny-wide")
    chosen = base["plan"]["choices"]
    assert chosen["checkpointing"] == "none" and chosen["optimizer"]["placement"] == "device", chosen
    assert not chosen["chunked_loss"] and base["plan"]["accumulation"] == 1, base["plan"]
    expected = (lean_row["tokens_per_s"] * lean_row["parameters"]) / (base["tokens_per_s"] * base["parameters"])
    assert doc["ratio"] == pytest.approx(expected), (doc["ratio"], expected)
    assert doc["target_met"] == (doc["ratio"] >= 0.5) and doc["fits"] is None


def test_lean_fallback_runs_the_other_shape_when_the_first_finds_no_plan(lean, tmp_path, monkeypatch):
    # On the GPU the fallback is the 1.1B in 4 GiB; here the wider tiny shape in half its no-savings peak.
    monkeypatch.setattr(lean, "FALLBACK", "tiny-wide")
    monkeypatch.setitem(lean.BUDGETS, "tiny-wide", "0.5x")
    out = tmp_path / "lean.json"
    code = lean.main(["--small", "--device", "cpu", "--budget", "0.1x", "--fallback", "--warmup", "0",
                      "--repeats", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    first, second, base = doc["rows"]
    assert "no set-up fits" in first["error"] and first["shape"] == "tiny", first
    assert second["shape"] == "tiny-wide" and second.get("error") is None, second
    assert base["role"] == "baseline" and code == 0
    assert doc["ratio"] == pytest.approx(second["tokens_per_s"] * second["parameters"]
                                         / (base["tokens_per_s"] * base["parameters"]))


def test_lean_baseline_takes_the_next_candidate_after_out_of_memory(lean, monkeypatch):
    tried = []

    def fake_run(settings, shape, **kwargs):
        tried.append((shape, settings.micro_batch_size))
        if len(tried) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"tokens_per_s": 1000.0, "median_s": 1.0, "seconds": [1.0]}

    monkeypatch.setattr(lean, "run_settings", fake_run)
    args = lean.parse_args(["--small", "--device", "cpu", "--device-memory", "1GiB"])
    row = lean.baseline_row(args, torch.device("cpu"))
    assert len(tried) == 2 and row.get("error") is None, (tried, row)
    assert "out of memory" in row["tried"][0]["error"], row["tried"]
    first = (row["tried"][0]["shape"], row["tried"][0]["batch"])
    assert first == ("tiny-wide", 8), f"the largest shape at the largest batch goes first, not {first}"
    assert (row["shape"], row["batch"]) == ("tiny-wide", 4), row
    assert row["parameters"] == lean.SHAPES["tiny-wide"].parameters


# -- benchmarks/gpu_check.sh quick: the device check that fits one lease (issue 18) ------------------------------
LEASE_S = 480  # 8 of the ~13 usable minutes of a lease: time to rerun a failed step
RESULT_FILES = 8  # what comes back from a run on the device machine


def _dry_run(stage: str, tmp_path: Path, **env: str) -> list[str]:
    import os
    import subprocess

    run = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh"), "--dry-run", stage], capture_output=True,
                         text=True, timeout=60, cwd=BENCHMARKS.parent,
                         env={**{k: v for k, v in os.environ.items() if k != "PYTHON"}, "OUT": str(tmp_path / "out"),
                              **env})
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "out").exists(), "a dry run must not write anything"
    return run.stdout.strip().splitlines()


def _steps(lines: list[str]) -> list[tuple[str, int, list[str], str]]:
    import re

    steps = []
    for line in lines:
        m = re.fullmatch(r"step (\S+) limit (\d+)s writes (\S+): (.*)", line)
        if m:
            steps.append((m[1], int(m[2]), [] if m[3] == "-" else m[3].split(","), m[4]))
    return steps


@pytest.mark.parametrize("stage", ["quick", "tests", "plan", "lean", "bench", "optim", "compile", "all"])
def test_gpu_check_dry_run_declares_every_limit_and_file(stage, tmp_path):
    import re

    lines = _dry_run(stage, tmp_path)
    total = re.fullmatch(r"total (\d+)s", lines[-1])
    assert total, f"the last line must be 'total <N>s', got {lines[-1]!r}"
    steps = _steps(lines)
    assert steps and steps[0][0] == "environment", lines
    assert int(total[1]) == sum(limit for _, limit, _, _ in steps), lines
    files = re.fullmatch(r"files (\d+): (.*)", lines[-2])
    assert files, lines[-2]
    names = files[2].split()
    assert len(names) == int(files[1]) == len(set(names)), f"result files named twice: {names}"
    assert len(names) <= RESULT_FILES, f"{stage} writes {len(names)} result files, {RESULT_FILES} come back: {names}"
    assert names[0] == f"{stage}.log", names
    for name, _, writes, command in steps:
        # Every file a command writes is under $OUT and declared: what the count above counts is what is written.
        outs = re.findall(r"--out (\S+)", command)
        assert [Path(o).name for o in outs] == writes, f"{name}: writes {outs}, declares {writes}"
        assert all(Path(o).parent == tmp_path / "out" for o in outs), outs
        assert command.split()[0] in ("python3", "env"), f"{name}: {command.split()[0]}, not python3"


def test_gpu_check_quick_fits_one_lease_and_covers_the_issue(tmp_path):
    import re

    lines = _dry_run("quick", tmp_path)
    total = int(re.fullmatch(r"total (\d+)s", lines[-1])[1])
    assert total <= LEASE_S, f"quick's limits add to {total} s, over the {LEASE_S} s a lease allows"
    commands = {name: command for name, _, _, command in _steps(lines)}
    assert "pytest" in commands["tests-gpu"] and "tests/gpu" in commands["tests-gpu"]
    assert "MEMTRAIN_GPU_TEST_TIMEOUT=" in commands["tests-gpu"], "every GPU test needs a limit"
    # Issue 11's two targets, one budget each (issue 28: the other two moved to the plan stage).
    assert "--budgets 8GiB,24GiB+compile " in commands["plans"], commands["plans"]
    assert "torch save_on_cpu" in commands["activation-offload"]
    assert "torchao CPUOffloadOptimizer" in commands["optimizer-offload"]
    # $PYTHON still chooses the interpreter.
    custom = _dry_run("quick", tmp_path, PYTHON="/opt/py/bin/python")
    assert all(c.split()[0] in ("/opt/py/bin/python", "env") for *_, c in _steps(custom))


def test_gpu_check_rejects_an_unknown_stage(tmp_path):
    import subprocess

    run = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh"), "--dry-run", "quik"], capture_output=True,
                         text=True, timeout=30, cwd=BENCHMARKS.parent)
    assert run.returncode == 2 and "usage:" in run.stderr and "quik" in run.stderr, run


def test_gpu_tests_conftest_fails_a_test_past_its_limit_and_runs_the_next(tmp_path):
    # tests/gpu/conftest.py's limit, exercised on the CPU: the device has no pytest-timeout.
    import os
    import shutil
    import subprocess

    shutil.copy(Path(__file__).parent / "gpu" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sleepy.py").write_text(
        "import time, pytest\n"
        "def test_hangs():\n    time.sleep(30)\n"
        "@pytest.mark.time_limit(20)\n"
        "def test_own_limit():\n    time.sleep(2)\n"
        "def test_after():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**os.environ, "MEMTRAIN_GPU_TEST_TIMEOUT": "1"})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed, 2 passed" in run.stdout, run.stdout
    assert "GPUTestTimeout" in run.stdout and "test_hangs ran past its 1 s limit" in run.stdout, run.stdout


def test_the_benchmarks_read_a_stored_plan_through_its_settings(lean):
    """A plan is stored as its run shape and choices: a device optimizer with a share offloaded saves no placement
    (the share says it), and a plan of an older revision (each field its own key) is the same set-up as this one's."""
    from helpers import fields_form

    from memtrain.planner.settings import PlanSettings

    shared = PlanSettings(micro_batch_size=2, accumulation=1, blocks=("recompute", "keep"), flavor="full",
                          distribution="none", offload_fraction=0.5, state_precision="bf16")
    assert shared.to_dict()["choices"]["optimizer"]["placement"] is None  # what master_text once indexed
    assert lean.master_text(shared.to_dict()) == "fp32 weights on the device"
    speed = _load("bench_plan_speed")
    mine = {"plan": shared.to_dict(), "peak_bytes": 1, "host_bytes": 2, "step_seconds": 0.5, "tokens_per_s": 9.0}
    older = {**mine, "plan": fields_form(shared)}
    assert speed._same_choice(older, mine) and not speed._same_choice({**older, "peak_bytes": 3}, mine)
    other = PlanSettings(**{**{f: getattr(shared, f) for f in ("micro_batch_size", "accumulation", "flavor",
                                                             "distribution")}, "blocks": ("keep", "keep")})
    assert not speed._same_choice({**mine, "plan": fields_form(other)}, mine)
