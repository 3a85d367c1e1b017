"""A finished run's report: ``report.json`` (the plan, its prediction, the measurement at step 2, the re-plans,
memory with memtrain beside plain training) and its plots ``loss.png`` and ``memory.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memtrain.estimate import estimate
from memtrain.files import atomic_write_bytes
from memtrain.report import CATEGORIES, plot_loss, plot_memory
from memtrain.run.replan import RunPlan


def write_run_report(out: Path, metrics: list[dict[str, Any]], run_plan: RunPlan, check: dict[str, Any] | None,
                     replans: list[dict[str, Any]], model: nn.Module, global_batch: int, seq_len: int,
                     device: torch.device, world: int) -> dict[str, Any]:
    """report.json, loss.png and memory.png: the plan, its prediction and the measurement at step 2, the re-plans,
    and the run's memory with memtrain (measured) beside plain training (estimated: fp32, no checkpointing, the
    whole global batch in one forward). Returns the report."""
    measured = metrics[-1]
    with_memtrain = {key: measured[key] for key, _ in CATEGORIES}
    report: dict[str, Any] = {
        "plan": run_plan.plan.to_dict() if run_plan.plan is not None else {"settings": run_plan.settings.to_dict()},
        "prediction": run_plan.to_dict(),
        "measurement": check,
        "replans": replans,
        "with_memtrain": with_memtrain,
        "without_memtrain": None,
    }
    if world > 1:
        report["without_memtrain_error"] = "not estimated under torchrun (the estimate is for one process)"
    else:
        try:
            plain = estimate(model, (global_batch, seq_len), device=device.type, precision="fp32",
                             checkpointing="none", optimizer="adamw")
            report["without_memtrain"] = {key: getattr(plain, key) for key, _ in CATEGORIES}
            report["without_memtrain_assumes"] = ("fp32, no checkpointing, the whole global batch in one forward, "
                                                  "AdamW on the device (estimated)")
        except Exception as e:  # noqa: BLE001 - the run is done and saved; a missing comparison is only reported
            report["without_memtrain_error"] = f"{type(e).__name__}: {e}"
    atomic_write_bytes(out / "report.json", json.dumps(report, indent=2, default=str).encode())
    plot_loss(str(out / "loss.png"), metrics)
    bars = {"with memtrain (measured)": with_memtrain}
    if report["without_memtrain"]:
        bars = {"without memtrain (estimated)": report["without_memtrain"], **bars}
    plot_memory(str(out / "memory.png"), bars)
    return report
