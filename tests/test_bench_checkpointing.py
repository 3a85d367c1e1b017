"""Smoke test of benchmarks/bench_checkpointing.py: a tiny shape, one repeat, every case and sane figures.

No timing is asserted (speed lives in the benchmark's own output); what is checked is that the benchmark compares
like with like: every case ran, the cases trained the same model to the same loss, and the saved bytes are
ordered as checkpointing promises.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from memtrain import ConfigError  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_checkpointing.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_checkpointing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is being executed
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    """One tiny run with --json; returns (the JSON file's document, what stdout carried)."""
    out = tmp_path_factory.mktemp("bench") / "checkpointing.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        bench.main(["--tiny", "--repeats", "1", "--device", "cpu", "--json", "--out", str(out)])
    return json.loads(out.read_text()), stdout.getvalue()


def test_every_case_ran_with_sane_figures(bench, run):
    doc, _ = run
    results = {r["name"]: r for r in doc["results"]}
    assert list(results) == list(bench.CONFIGURATIONS), f"cases in the JSON: {list(results)}"
    assert doc["baseline"] == bench.BASELINE
    for name, r in results.items():
        assert r["error"] is None, f"{name} failed: {r['error']}"
        assert len(r["seconds"]) == 1 and r["median_s"] > 0, f"{name}: seconds {r['seconds']}"
        assert r["ratio"] > 0 and r["tokens_per_s"] > 0, f"{name}: ratio {r['ratio']}, tokens/s {r['tokens_per_s']}"
        figures = r["figures"]
        assert isinstance(figures["activation_bytes"], int) and figures["activation_bytes"] > 0, figures
        assert figures["cpu_s"] > 0, figures
        assert math.isfinite(figures["loss"]), figures
        assert figures["reduction"] == pytest.approx(
            results[bench.BASELINE]["figures"]["activation_bytes"] / figures["activation_bytes"]
        ), f"{name}: reduction {figures['reduction']} is not baseline bytes / case bytes"
    assert results[bench.BASELINE]["ratio"] == 1.0
    assert results[bench.BASELINE]["figures"]["reduction"] == 1.0


def test_cases_train_the_same_model(bench, run):
    # Checkpointing changes what is kept, not what is computed: after the same steps every case has the same loss.
    doc, _ = run
    losses = {r["name"]: r["figures"]["loss"] for r in doc["results"]}
    base = losses[bench.BASELINE]
    for name, loss in losses.items():
        assert loss == pytest.approx(base, rel=1e-5), f"{name}: loss {loss} vs no checkpointing {base}"


def test_saved_bytes_are_ordered_as_checkpointing_promises(bench, run):
    doc, _ = run
    saved = {r["name"]: r["figures"]["activation_bytes"] for r in doc["results"]}
    none, hf, full = saved["no checkpointing"], saved["hf gradient_checkpointing_enable"], saved["memtrain full"]
    every2, selective = saved["memtrain every=2"], saved["memtrain selective(matmul,attention)"]
    # The same blocks are checkpointed by Hugging Face and by memtrain: the same bytes are kept. memtrain hands the
    # blocks' keyword tensors to checkpoint positionally (their RNG devices are then known), where the meter sees
    # them: the rotary cos and sin (fp32) and position_ids (int64), one copy shared by every block. Hugging Face
    # keeps them alive in a closure, out of the meter's sight.
    shape = bench.SHAPES["tiny"]
    keywords = 2 * shape.seq_len * (shape.hidden // shape.heads) * 4 + shape.seq_len * 8
    assert full == hf + keywords, f"memtrain full keeps {full} bytes, Hugging Face {hf} + {keywords} keyword bytes"
    assert full < every2 < none, f"full {full}, every=2 {every2}, none {none}: every=2 must lie in between"
    assert full < selective < none, f"full {full}, selective {selective}, none {none}"
    chunked = saved["memtrain full + chunked loss"]
    assert chunked < full, f"a chunked loss must keep less than the whole fp32 logits: {chunked} vs {full}"


def test_notes_say_what_each_case_did(run):
    doc, _ = run
    notes = {r["name"]: r["notes"] for r in doc["results"]}
    # transformers 5 checkpoints non-reentrantly, as memtrain does: the comparison is like with like.
    assert notes["hf gradient_checkpointing_enable"].endswith("(use_reentrant=False)"), notes
    assert notes["memtrain every=2"] == "apply_checkpointing(model, every=2)", notes


def test_json_flag_prints_only_the_json_document(run):
    doc, stdout = run
    assert json.loads(stdout) == doc, f"stdout was not the JSON document alone:\n{stdout[:500]}"


def test_conflicting_flags_raise_one_config_error(bench):
    with pytest.raises(ConfigError, match="--tiny and --shape") as info:
        bench.main(["--tiny", "--shape", "llama-1.1b", "--repeats", "0"])
    assert "repeats must be >= 1" in str(info.value), str(info.value)
