"""A finished run's report: ``report.json`` (the plan, its prediction, the measurement at step 2, the re-plans,
memory with memtrain beside plain training) and its plots ``loss.png`` and ``memory.png`` (the categories beside
plain training, and memory per step against the budget, the predicted and the measured peak); the plan in one line
for ``quiet`` runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memtrain.estimate import estimate
from memtrain.files import atomic_write_bytes
from memtrain.planner import planning_device
from memtrain.report import CATEGORIES, format_bytes, memory_bars, plot_loss, save_figure
from memtrain.run.replan import PlanInForce
from memtrain.run.state import PlanCheck


def write_run_report(out: Path, metrics: list[dict[str, Any]], in_force: PlanInForce, check: PlanCheck | None,
                     replans: list[dict[str, Any]], model: nn.Module, global_batch: int, seq_len: int,
                     device: torch.device, world: int) -> dict[str, Any]:
    """report.json, loss.png and memory.png: the plan, its prediction and the measurement at step 2, the re-plans,
    and the run's memory with memtrain (measured) beside plain training (estimated: fp32, no checkpointing, the
    whole global batch in one forward). Returns the report."""
    measured = metrics[-1]
    with_memtrain = {key: measured[key] for key, _ in CATEGORIES}
    report: dict[str, Any] = {
        "plan": in_force.plan.to_dict() if in_force.plan is not None else {"settings": in_force.settings.to_dict()},
        "prediction": in_force.to_dict(),
        "measurement": check.to_dict() if check is not None else None,
        "replans": replans,
        "with_memtrain": with_memtrain,
        "without_memtrain": None,
    }
    if world > 1:
        report["without_memtrain_error"] = "not estimated under torchrun (the estimate is for one process)"
    else:
        try:
            plain = estimate(model, (global_batch, seq_len), device=planning_device(device), precision="fp32",
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
    save_figure(memory_figure(bars, metrics, in_force, replans), str(out / "memory.png"))
    return report


# memory.png's timeline: metrics.jsonl's memory figures of each step.
TIMELINE = (("peak_reserved_bytes", "allocator peak reserved", "tab:pink"),
            ("peak_bytes", "allocator peak", "tab:purple"), ("activation_bytes", "saved activations", "tab:blue"),
            ("model_state_bytes", "model state", "tab:green"))


def memory_figure(bars: dict[str, dict[str, int]], metrics: list[dict[str, Any]], in_force: PlanInForce,
                  replans: list[dict[str, Any]]) -> Any:
    """memory.png's figure (a ``matplotlib.figure.Figure``): on the left each category's bytes, ``bars`` side by
    side; on the right the memory of each optimizer step (the allocator's peak, CUDA only; the bytes saved for
    backward; the model state) on a log scale, against the budget, the predicted peak and saved activations of
    the plan at the end, the measured peak (the highest step's) and the steps that re-planned. The allocator's
    reserved peak (CUDA: what it holds from the driver, fragmentation included) is drawn above its allocated one."""
    from matplotlib.figure import Figure  # no pyplot: no global figure registry, no GUI backend
    from matplotlib.ticker import MaxNLocator

    # Constrained layout: the tick labels, the titles and the legend beside the plot each get their own room.
    fig = Figure(figsize=(14, 5), layout="constrained")
    bars_ax, steps_ax = fig.subplots(1, 2, width_ratios=(1, 1.3))
    memory_bars(bars_ax, bars)
    steps = [m["step"] for m in metrics]
    for key, label, color in TIMELINE:
        values = [m.get(key) for m in metrics]
        if any(v is not None for v in values):
            steps_ax.plot(steps, [v / 2**20 if v is not None else math.nan for v in values], ".-", color=color,
                          label=label)
    peaks = [m["peak_bytes"] for m in metrics if m.get("peak_bytes") is not None]
    p = in_force.plan
    levels = (("budget", in_force.budget_bytes, "-", "red"),
              ("predicted peak", p.peak_bytes if p else None, "--", "tab:purple"),
              ("measured peak", max(peaks) if peaks else None, ":", "tab:purple"),
              ("predicted saved activations", p.activation_bytes if p else None, "--", "tab:blue"))
    for name, value, style, color in levels:
        if value is not None:
            steps_ax.axhline(value / 2**20, linestyle=style, color=color, linewidth=1,
                             label=f"{name} {format_bytes(value)}")
    for replan in replans:
        steps_ax.axvline(replan["step"], color="grey", linewidth=0.8, label=f"re-plan at step {replan['step']}")
    steps_ax.set_yscale("log")
    steps_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps_ax.set_xlabel("optimizer step")
    steps_ax.set_ylabel("MiB (log scale)")
    steps_ax.set_title("memory per step" + ("" if peaks else " (no allocator peak on this device)"))
    steps_ax.grid(alpha=0.3, which="both")
    steps_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines, never over them
    return fig


def plan_summary(in_force: PlanInForce, precision: str) -> str:
    """The plan in one line, for a ``quiet`` run (instead of each choice with its reason)."""
    s, p = in_force.settings, in_force.plan
    budget = f" of the budget {format_bytes(in_force.budget_bytes)}" if in_force.budget_bytes is not None else ""
    predicted = f"; predicted peak {format_bytes(p.peak_bytes)} per rank{budget}" if p is not None else ""
    return (f"plan: {precision}; checkpointing {s.checkpointing}; loss {s.loss_text}; "
            f"optimizer {s.optimizer_text}{', compiled' if s.compile else ''}; micro-batch {s.micro_batch_size} x "
            f"{s.accumulation} accumulation{predicted}")
