"""Issue 14's GPU target: a Llama-7B shape trained inside 24 GiB with fp32-master AdamW, against no technique at all.

The lean run: a Hugging Face ``LlamaForCausalLM`` of Llama-2 7B's shape (hidden 4096, intermediate 11008, 32
layers, 32 heads, vocabulary 32000; 6.74B parameters, random init, SDPA), sequence 2048, a global batch of
``--global-batch`` (8) sequences, bf16 autocast. ``plan(...)`` chooses everything else for a 24 GiB budget: the
micro-batch and accumulation, checkpointing, the loss, and where the optimizer lives. Every full-parameter set-up
it can choose keeps AdamW's fp32 master weights: on the device (fp32 weights), or in host RAM with bf16 weights on
the device (``offload-bf16-weights``: 7B fp32 weights alone are 27 GB, more than 24 GiB, so the 7B plan must take
it). The moments are fp32 unless the plan chooses bf16 or int8 ones (``--fp32-moments`` forbids that); the row
says which. The model is built on the device directly in the plan's weight dtype (bf16 here: 13.5 GB), never in
fp32 first, so that the whole process stays inside the budget; its fp32 master is then the bf16 initialisation
widened (a fine-tune would load fp32 weights into it instead).

What the 24 GiB measures: ``torch.cuda.max_memory_reserved()`` of the caching allocator over the whole run (model
set-up, the warm-up and the timed steps); ``max_memory_allocated`` and the timed steps' peaks are reported beside
it. The CUDA context (about 0.5 GiB) is outside both.

The baseline: the same GPU's unconstrained run of the largest model that trains there with no technique at all
(fp32 weights, fused AdamW on the device, every activation kept, the whole-logits loss, no accumulation). The
candidates are Llama shapes, largest first (7B, OpenLLaMA-3B's, the 1.1B), each at the largest batch in 8, 4, 2,
1 (at most ``--global-batch``) whose ``estimate`` fits 90% of the device's memory (the estimate is within about
10%); a candidate that still runs out of memory gives way to the next. The two runs are compared per
parameter-token: tokens/s x parameters (both ~ FLOP/s / 6), target: the lean run at >= 50% of the baseline's.

``--shape 1.1b``: docs/design.md's 1.1B Llama inside 4 GiB instead (issue 14's fallback when 15 minutes of device time
cannot hold the 7B run); ``--fallback`` runs it by itself when the 7B run finds no plan, fails or runs out of time.

Each run is a fresh process (``--isolate process``, the default on CUDA) with its own time limit. Run on a GPU:
``python benchmarks/gpu_lean_optimizer.py --fallback`` (about 3 minutes on an H200; 128 GiB of host RAM: the
7B plan's host side is about 115 GiB). Run anywhere: ``python benchmarks/gpu_lean_optimizer.py --small`` (tiny
Llamas on this machine's CPU, the budget a fraction of the no-savings peak: checks the whole path end to end; its
times mean nothing and no peak is measurable).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (gpu_plan), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from gpu_plan import (  # noqa: E402
    MIN_CHILD_S,
    SHAPES,
    Deadline,
    _error,
    _free,
    _kill_children,
    _tps,
    environment,
    fp32_moments_only,
    judge,
    measure_budget,
    no_savings_peak,
    no_technique,
    parse_budgets,
    run_child,
    run_settings,
    write_doc,
)

from memtrain.errors import ConfigError  # noqa: E402
from memtrain.planner.settings import PlanSettings  # noqa: E402
from memtrain.report import format_bytes, parse_bytes  # noqa: E402

# The lean run's budget per shape (issue 14: the 7B in 24 GiB, or the 1.1B in 4 GiB), and --small's: 0.48x. The
# tiny shape's leanest set-up peaks at 68 MiB, 64 of them cuBLAS's workspaces, whose two 32 MiB blocks take 20 MiB
# pages of the caching allocator's expandable segment: it runs in 85.3 MiB, which the plan budgets (0.46x of the
# no-savings peak, less the lean run's 10% margin, is 84.9 MiB).
BUDGETS = {"7b": "24GiB", "1.1b": "4GiB", "tiny": "0.48x"}
LADDER = ("7b", "3b", "1.1b")  # baseline candidates, largest first
SMALL_LADDER = ("tiny-wide", "tiny")
BASELINE_BATCHES = (8, 4, 2, 1)
BASELINE_MARGIN = 0.10  # of the device's memory: the estimate's error
TARGET_RATIO = 0.5  # issue 14: the lean run's rate per parameter-token at least half the baseline's
FALLBACK = "1.1b"


def parameters(shape_name: str) -> int:
    return SHAPES[shape_name].parameters


def master_text(plan: dict[str, Any]) -> str:
    """Where the plan keeps AdamW's fp32 master weights (every placement keeps one: build_optimizer refuses
    non-fp32 device weights, and the offloaded optimizers hold the master in host RAM)."""
    placement = PlanSettings.from_dict(plan).optimizer
    return {"device": "fp32 weights on the device", "offload": "fp32 master in host RAM, fp32 device weights",
            "offload-bf16-weights": "fp32 master in host RAM, bf16 device weights"}[placement]


def lean_row(args: argparse.Namespace, shape_name: str, device: torch.device) -> dict[str, Any]:
    """Plans ``shape_name`` for its budget and trains it (``gpu_plan.measure_budget``), with the figures per
    parameter-token."""
    shape = SHAPES[shape_name]
    # --budget is the first shape's; the fallback shape runs in its own (the 1.1B in 4 GiB)
    budget_text = args.budget if args.budget and shape_name == args.shape else BUDGETS[shape_name]
    spec = parse_budgets(budget_text, lambda: no_savings_peak(shape, args.seq_len, args.global_batch))[0]
    techniques = fp32_moments_only() if args.fp32_moments else None
    host_budget = parse_bytes(args.host_budget) if args.host_budget else None
    row = measure_budget(spec, shape, seq_len=args.seq_len, batch=args.global_batch, device=device,
                         calibrated=args.calibrate, warmup=args.warmup, repeats=args.repeats, lr=args.lr,
                         host_budget=host_budget, techniques=techniques)
    row.update(role="lean", shape=shape_name, parameters=shape.parameters)
    if "plan" in row:
        row["master"] = master_text(row["plan"])
        row["moments"] = PlanSettings.from_dict(row["plan"]).state_precision
    return row


def baseline_candidates(ladder: Sequence[str], seq_len: int, max_batch: int, memory_bytes: int
                        ) -> tuple[list[tuple[str, int]], list[dict[str, Any]]]:
    """The (shape, batch) set-ups to try, best first, and every estimate made to choose them (for the JSON).

    Best: the largest shape at its largest batch whose no-technique estimate fits ``memory_bytes`` less the
    margin; each shape's smaller fitting batches follow it, then the next shape's (run when one runs out of
    memory after all)."""
    usable = int(memory_bytes * (1 - BASELINE_MARGIN))
    chosen: list[tuple[str, int]] = []
    estimates = []
    for name in ladder:
        for batch in (b for b in BASELINE_BATCHES if b <= max_batch):
            peak = no_savings_peak(SHAPES[name], seq_len, batch)
            estimates.append({"shape": name, "batch": batch, "predicted_peak_bytes": peak, "fits": peak <= usable})
            if peak <= usable:
                chosen.append((name, batch))
    return chosen, estimates


def baseline_row(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The unconstrained run: the best candidate that trains without running out of memory."""
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        source = f"{torch.cuda.get_device_name(device)}'s total memory"
    elif args.device_memory:
        memory, source = parse_bytes(args.device_memory), "--device-memory"
    else:  # a CPU smoke run: a pretend device on which the smallest ladder shape fits at batch 1
        smallest = (SMALL_LADDER if args.small else LADDER)[-1]
        memory = int(1.25 * no_savings_peak(SHAPES[smallest], args.seq_len, 1) / (1 - BASELINE_MARGIN))
        source = f"pretend: 1.25x the {smallest} shape's no-technique estimate at batch 1 (no device here)"
    candidates, estimates = baseline_candidates(SMALL_LADDER if args.small else LADDER, args.seq_len,
                                                args.global_batch, memory)
    row: dict[str, Any] = {"role": "baseline", "device_memory_bytes": memory, "device_memory_source": source,
                           "margin": BASELINE_MARGIN, "estimates": estimates, "tried": []}
    print(f"-- baseline: device memory {format_bytes(memory)} ({source}); no-technique set-ups that fit "
          f"{100 * (1 - BASELINE_MARGIN):.0f}% of it, best first: {candidates or 'none'}", flush=True)
    for name, batch in candidates:
        settings = no_technique(SHAPES[name], batch)
        measured = None
        try:
            measured = run_settings(settings, SHAPES[name], seq_len=args.seq_len, device=device,
                                    warmup=args.warmup, repeats=args.repeats, lr=args.lr)
        except torch.OutOfMemoryError as e:
            row["tried"].append({"shape": name, "batch": batch, "error": _error(e)})
        except Exception as e:  # noqa: BLE001 - recorded; a smaller set-up will not fix another failure
            row["error"] = f"run {name} at batch {batch}: {_error(e)}"
            break
        _free(device)  # after the except clause: its traceback held the failed run's frames (model, optimizer)
        if measured is None:
            print(f"-- baseline {name} at batch {batch}: out of memory, trying the next", flush=True)
            continue
        predicted = next(e["predicted_peak_bytes"] for e in estimates if (e["shape"], e["batch"]) == (name, batch))
        row.update(measured, shape=name, batch=batch, parameters=SHAPES[name].parameters,
                   predicted_peak_bytes=predicted, plan=settings.to_dict(), budget_bytes=memory)
        judge(row)  # the device's memory is its budget; allocated over predicted: the estimate's error there
        return row
    row["error"] = row.get("error") or "no candidate ran: every one was over the device's memory"
    return row


def per_parameter_token(row: dict[str, Any] | None) -> float | None:
    if not row or row.get("error") or not row.get("tokens_per_s"):
        return None
    return row["tokens_per_s"] * row["parameters"]


def summary(doc: dict[str, Any]) -> str:
    lines = []
    for row in doc["rows"]:
        name = {"lean": f"lean: {row.get('shape')} in {row.get('budget')}", "baseline": "baseline (no technique)"}[
            row["role"]]
        shape = row.get("shape", "-")
        what = row.get("choice") or (f"{shape} at batch {row['batch']}" if row.get("batch") else "-")
        rate = per_parameter_token(row)
        lines.append(
            f"  {name:28s} {what}\n"
            f"  {'':28s} predicted {format_bytes(row.get('predicted_peak_bytes'))}, allocated "
            f"{format_bytes(row.get('run_peak_allocated_bytes'))}, reserved {format_bytes(row.get('run_peak_reserved_bytes'))}"
            f" (whole run), {'-' if row.get('median_s') is None else format(row['median_s'], '.3f')} s/step, "
            f"{_tps(row.get('tokens_per_s'))} tokens/s, "
            f"{'-' if rate is None else format(rate, '.3g')} parameter-tokens/s"
            + (f"\n  {'':28s} failed: {row['error']}" if row.get("error") else ""))
    ratio = doc.get("ratio")
    verdict = "not measured" if ratio is None else (
        f"{ratio:.2f} of the baseline's rate per parameter-token (target >= {TARGET_RATIO}: "
        f"{'met' if doc['target_met'] else 'NOT met'})")
    fits = {None: "not measured", True: "yes", False: "NO"}[doc.get("fits")]
    lean = next((r for r in reversed(doc["rows"]) if r["role"] == "lean"), {})
    lines.append(f"  lean run: {lean.get('master', '-')}, {lean.get('moments', '-')} moments; inside its budget "
                 f"(reserved over the whole run): {fits}; {verdict}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny Llamas on this machine (CPU smoke run)")
    parser.add_argument("--shape", choices=("7b", "1.1b", "tiny"), help="the lean run's shape (default 7b; tiny "
                        "with --small)")
    parser.add_argument("--budget", help="the lean run's budget (default 24GiB for 7b, 4GiB for 1.1b, 0.48x of the "
                        "no-savings peak for tiny)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (the planner "
                        "picks the micro-batch and accumulation)")
    parser.add_argument("--seq-len", type=int, help="default 2048 (256 with --small)")
    parser.add_argument("--fp32-moments", action="store_true", help="forbid bf16/int8 AdamW moments")
    parser.add_argument("--fallback", action="store_true", help=f"when the lean run fails, run the {FALLBACK} "
                        f"shape in {BUDGETS[FALLBACK]} instead")
    parser.add_argument("--calibrate", action="store_true", help="device figures from calibrate('cuda')")
    parser.add_argument("--host-budget", help="host RAM the plan may use (default: what is free now)")
    parser.add_argument("--device-memory", help="the baseline's device memory on a CPU run (default: pretend)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--isolate", choices=("process", "none"), help="a fresh process per run (default on CUDA)")
    parser.add_argument("--lean-timeout", type=float, default=200.0, help="seconds the lean run's process may take")
    parser.add_argument("--fallback-timeout", type=float, default=90.0)
    parser.add_argument("--baseline-timeout", type=float, default=90.0)
    parser.add_argument("--deadline", type=float, help="seconds the whole run may take (each process's limit is cut "
                        "to what is left; a run with under a minute left is skipped)")
    parser.add_argument("--role", choices=("all", "lean", "baseline"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="the JSON file (default bench-results/gpu_lean_optimizer-<shape>.json)")
    parser.add_argument("--json", action="store_true", help="also print the JSON document on stdout")
    args = parser.parse_args(argv)
    args.shape = args.shape or ("tiny" if args.small else "7b")
    args.seq_len = args.seq_len or (256 if args.small else 2048)
    args.isolate = args.isolate or ("process" if args.device.startswith("cuda") else "none")
    problems = []
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append("--device cuda, but torch sees no CUDA device. To resolve this error, run on the GPU "
                        "machine, or pass --small --device cpu for the smoke run.")
    if not args.device.startswith("cuda") and not args.small:
        problems.append(f"--device {args.device} without --small: the {args.shape} shape would take hours on a CPU. "
                        "To resolve this error, pass --small (tiny Llamas), or run on a GPU.")
    if (args.shape == "tiny") != args.small:
        problems.append(f"--shape {args.shape} {'without' if args.small is False else 'with'} --small: tiny is "
                        "--small's shape, 7b and 1.1b the GPU's.")
    if args.calibrate and not torch.cuda.is_available():
        problems.append("--calibrate probes the CUDA device, and torch sees none. To resolve this error, drop it.")
    for name in ("global_batch", "seq_len", "repeats"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1.")
    if args.warmup < 0:
        problems.append(f"--warmup {args.warmup} must be >= 0.")
    ConfigError.raise_if(problems)
    return args


def child_argv(args: argparse.Namespace, role: str, shape: str) -> list[str]:
    argv = ["--role", role, "--shape", shape, "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
            "--device", args.device, "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--lr",
            str(args.lr), "--isolate", "none"]
    flags = {"--small": args.small, "--calibrate": args.calibrate, "--fp32-moments": args.fp32_moments}
    argv += [flag for flag, on in flags.items() if on]
    for flag, value in (("--budget", args.budget if shape == args.shape else None), ("--host-budget", args.host_budget),
                        ("--device-memory", args.device_memory)):
        if value:
            argv += [flag, value]
    return argv


def run(args: argparse.Namespace, role: str, shape: str, device: torch.device, timeout_s: float,
        clock: Deadline) -> dict[str, Any]:
    """One run (lean or baseline), in a fresh process or in this one."""
    if clock.left() < MIN_CHILD_S:
        return {"role": role, "shape": shape, "error": f"skipped: {clock.left():.0f} s left of --deadline"}
    if args.isolate == "none":
        return lean_row(args, shape, device) if role == "lean" else baseline_row(args, device)
    print(f"== {role} run ({shape}): a fresh process ==", flush=True)
    started = time.perf_counter()
    child, why = run_child(child_argv(args, role, shape), min(timeout_s, clock.left()), script=__file__)
    row = child["rows"][0] if child and child["rows"] else {"role": role, "shape": shape, "error": why or "no result"}
    row["process_s"] = time.perf_counter() - started
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    path = Path(args.out or f"bench-results/gpu_lean_optimizer-{args.shape}.json")
    doc: dict[str, Any] = {"title": f"gpu_lean_optimizer-{args.shape}",
                           **environment(device, touch_cuda=args.isolate == "none"),
                           "global_batch": args.global_batch, "seq_len": args.seq_len, "warmup": args.warmup,
                           "repeats": args.repeats, "rows": []}
    if args.role != "all":  # a child: one run, one row
        row = lean_row(args, args.shape, device) if args.role == "lean" else baseline_row(args, device)
        doc["rows"].append(row)
        write_doc(path, doc)
        return 0
    if args.isolate == "process":
        signal.signal(signal.SIGTERM, _kill_children)
    clock = Deadline(args.deadline)
    lean = run(args, "lean", args.shape, device, args.lean_timeout, clock)
    doc["rows"].append(lean)
    write_doc(path, doc)
    if lean.get("error") and args.fallback and args.shape != FALLBACK:
        print(f"-- the {args.shape} run failed ({lean['error'][:200]}): the {FALLBACK} shape in "
              f"{BUDGETS[FALLBACK]} instead", flush=True)
        lean = run(args, "lean", FALLBACK, device, args.fallback_timeout, clock)
        doc["rows"].append(lean)
        write_doc(path, doc)
    baseline = run(args, "baseline", "-", device, args.baseline_timeout, clock)
    doc["rows"].append(baseline)
    lean_rate, base_rate = per_parameter_token(lean), per_parameter_token(baseline)
    doc["ratio"] = lean_rate / base_rate if lean_rate and base_rate else None
    doc["target_ratio"] = TARGET_RATIO
    doc["target_met"] = None if doc["ratio"] is None else doc["ratio"] >= TARGET_RATIO
    doc["fits"] = None if lean.get("error") else lean.get("fits")
    write_doc(path, doc)
    print(f"\n== gpu_lean_optimizer on {args.device}: sequence {args.seq_len}, global batch {args.global_batch} ==")
    print(summary(doc))
    print(f"results: {path}")
    if args.json:
        sys.stdout.write(path.read_text() + "\n")
    if lean.get("error"):
        return 3  # no lean run: gpu_check.sh says so (and --fallback was not given, or failed too)
    return 1 if baseline.get("error") else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
