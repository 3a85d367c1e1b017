"""The shared benchmark runner: named configurations side by side in one process, medians, ratios.

Every benchmark builds each configuration from the same model, data and seed, then calls ``run_side_by_side``.
On the CPU, repetitions are interleaved (case A, case B, ..., then A, B, ... again) so that drift of the
machine hits every case alike. On CUDA, cases run one after another by default (``isolate=True``) so that the
allocator peak of a case does not include the other cases' models.

Times are compared as ratios to a baseline measured in the same run; no absolute time is asserted anywhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memtrain.files import atomic_write_bytes
from memtrain.report import format_bytes

Step = Callable[[], dict[str, Any] | None]


@dataclass
class Case:
    """One configuration: ``setup()`` builds it from scratch (same seed) and returns a ``step()`` callable.

    ``step()`` runs one training step; it may return a dict of figures (e.g. ``{"activation_bytes": n}``), the
    last of which is reported.
    """

    name: str
    setup: Callable[[], Step]
    notes: str = ""


@dataclass
class Result:
    name: str
    seconds: list[float] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    peak_bytes: int | None = None
    error: str | None = None
    notes: str = ""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(step: Step, device: str) -> tuple[float, dict[str, Any] | None]:
    _sync(device)
    t0 = time.perf_counter()
    figures = step()
    _sync(device)
    return time.perf_counter() - t0, figures


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_side_by_side(
    cases: list[Case],
    *,
    title: str,
    repeats: int = 5,
    warmup: int = 1,
    device: str = "cpu",
    isolate: bool | None = None,
    baseline: str | None = None,
    json_path: str | os.PathLike[str] | None = None,
    tokens_per_step: int | None = None,
) -> list[Result]:
    """Runs every case ``warmup`` + ``repeats`` times and reports medians and ratios to ``baseline``.

    Args:
        cases: the configurations, built by their ``setup``.
        title: the benchmark's name, for the table and the JSON file.
        repeats: timed steps per case (the median is reported).
        warmup: untimed steps per case first (allocator warm-up, optimizer state creation).
        device: "cpu" or "cuda"; on CUDA the allocator peak over the timed steps is reported.
        isolate: run cases one after another instead of interleaved (default: True on CUDA).
        baseline: the case ratios are relative to (default: the first).
        json_path: where to write the results as JSON (default: ``bench-results/<title>.json``).
        tokens_per_step: when given, a tokens/s column is added.

    Returns:
        One ``Result`` per case, in order. A case that fails (e.g. out of memory) gets ``error`` set and the
        others still run.
    """
    isolate = device.startswith("cuda") if isolate is None else isolate
    results = {case.name: Result(case.name, notes=case.notes) for case in cases}

    def run_case(case: Case, steps: dict[str, Step]) -> None:
        result = results[case.name]
        if result.error is not None:
            return
        try:
            if case.name not in steps:
                steps[case.name] = case.setup()
                for _ in range(warmup):
                    _timed(steps[case.name], device)
                if device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
            seconds, figures = _timed(steps[case.name], device)
            result.seconds.append(seconds)
            if figures:
                result.figures.update(figures)
            if device.startswith("cuda"):
                result.peak_bytes = max(result.peak_bytes or 0, torch.cuda.max_memory_allocated())
        except Exception as e:  # noqa: BLE001 - one failing case must not hide the others' results
            result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            steps.pop(case.name, None)
            _free(device)

    if isolate:
        for case in cases:
            steps: dict[str, Step] = {}
            for _ in range(repeats):
                run_case(case, steps)
            steps.clear()
            _free(device)
    else:
        steps = {}
        for _ in range(repeats):
            for case in cases:
                run_case(case, steps)
        steps.clear()
        _free(device)

    ordered = [results[case.name] for case in cases]
    base = results.get(baseline or cases[0].name)
    print(format_table(ordered, title=title, base=base, tokens_per_step=tokens_per_step))
    path = Path(json_path or Path("bench-results") / f"{title}.json")
    write_json(path, ordered, title=title, base=base, device=device, tokens_per_step=tokens_per_step)
    return ordered


def format_table(results: list[Result], *, title: str, base: Result | None, tokens_per_step: int | None) -> str:
    figure_names = sorted({k for r in results for k in r.figures})
    header = ["config", "median s/step", "x baseline"]
    if tokens_per_step:
        header.append("tokens/s")
    header += figure_names
    if any(r.peak_bytes is not None for r in results):
        header.append("peak")
    rows = [header]
    for r in results:
        if r.error:
            rows.append([r.name, f"failed: {r.error}"] + [""] * (len(header) - 2))
            continue
        median = r.median_s
        ratio = median / base.median_s if base is not None and base.median_s else None
        row = [r.name, f"{median:.4f}", f"{ratio:.2f}x" if ratio else "-"]
        if tokens_per_step:
            row.append(f"{tokens_per_step / median:,.0f}")
        for k in figure_names:
            value = r.figures.get(k)
            row.append(format_bytes(value) if k.endswith("_bytes") and isinstance(value, int) else
                       f"{value:.3g}" if isinstance(value, float) else str(value if value is not None else "-"))
        if "peak" in header:
            row.append(format_bytes(r.peak_bytes))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(header))]
    lines = [f"== {title} =="]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows]
    return "\n".join(lines)


def write_json(path: Path, results: list[Result], *, title: str, base: Result | None, device: str,
               tokens_per_step: int | None) -> None:
    doc = {
        "title": title,
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "baseline": base.name if base else None,
        "results": [
            {
                "name": r.name,
                "seconds": r.seconds,
                "median_s": r.median_s,
                "ratio": (r.median_s / base.median_s) if base and base.median_s and r.median_s else None,
                "tokens_per_s": (tokens_per_step / r.median_s) if tokens_per_step and r.median_s else None,
                "peak_bytes": r.peak_bytes,
                "figures": r.figures,
                "error": r.error,
                "notes": r.notes,
            }
            for r in results
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(doc, indent=2).encode())


def common_args(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark script takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also print the JSON results on stdout")
    parser.add_argument("--out", help="JSON file to write (default bench-results/<title>.json)")
    return parser


def print_json_if_asked(args: argparse.Namespace, path: str | os.PathLike[str]) -> None:
    if args.json:
        sys.stdout.write(Path(path).read_text() + "\n")
