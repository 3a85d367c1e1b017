"""benchmarks/bench_finetune.py end to end at a tiny size: every variant trains, exports hf/ and is tabled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_finetune.py"


def test_every_variant_trains_and_exports(tmp_path):
    out = tmp_path / "finetune.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "6", "--hidden", "64", "--layers", "2",
                           "--seq-len", "64", "--batch", "4", "--docs", "120", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert set(rows) == {"full", "lora 8", "full, offloaded optimizer"}
    assert all(row["hf_loads"] and row["tokens_per_s"] > 0 for row in rows.values()), rows
    # LoRA trains the adapters alone: far fewer gradient and optimizer-state bytes than the full model's
    assert rows["lora 8"]["gradient_bytes"] * 4 < rows["full"]["gradient_bytes"], rows
    # the offloaded optimizer steps as AdamW on the device does (fp32 on the CPU)
    assert abs(rows["full, offloaded optimizer"]["loss_last4"] - rows["full"]["loss_last4"]) < 1e-4, rows
    assert "loss last 4" in done.stdout
