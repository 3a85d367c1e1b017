"""Issue 20's GPU check of parameter offload: docs/design.md's 1.1B Llama inside 4 GiB, its blocks' weights in host RAM.

``plan(...)`` with ``Choices(offload_weights=True)`` chooses the rest for the budget (the micro-batch, checkpointing,
the loss, the optimizer's moments); ``gpu_plan.run_settings`` builds the model on the device in the plan's weight
dtype, applies the plan (``apply_plan``: ``CPUOffloadOptimizer``, then ``WeightStreamer`` from its host master)
and trains a warm-up step and ``--steps`` timed steps on random tokens. The row sets the allocator's measured peaks
(over the timed steps, and over the whole run) beside the plan's predicted peak and tokens/s, and judges the fit
(``fits``) by three checks over the whole run (set-up and warm-up included): ``max_memory_allocated`` and
``max_memory_reserved`` within the budget (the allocator's cache counts: it is device memory no one else can use),
and ``torch.cuda.memory_stats()["num_alloc_retries"]`` 0 (a retry means cudaMalloc failed and the allocator freed its
cache to try again: the budget held only by thrashing). Each check is printed; a failed one makes the exit status 1.

Run on a GPU: ``python benchmarks/gpu_offload_weights.py --out gpu_offload_weights.json`` (the 1.1B: about 22 GB of
host RAM for the fp32 master, gradients, moments and the bf16 copies). Run anywhere: ``--small`` (a tiny Llama on
this machine's CPU: the whole path end to end; its times mean nothing and no peak is measurable).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (gpu_plan), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from gpu_plan import SHAPES, _error, environment, meta_llama, run_settings  # noqa: E402

from memtrain.choices import Choices  # noqa: E402
from memtrain.planner import plan  # noqa: E402
from memtrain.report import format_bytes, parse_bytes  # noqa: E402


def alloc_retries(device: torch.device) -> int | None:
    """cudaMalloc retries so far in this process (after a failed cudaMalloc the allocator frees its cache and tries
    again); None off CUDA."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else None


def budget_checks(row: dict[str, Any], budget_bytes: int | None) -> dict[str, bool | None]:
    """Whether the whole run fits ``budget_bytes``: its allocated and reserved peaks, and no allocation retried
    (None: not measurable here, e.g. on a CPU, or no budget)."""
    allocated, reserved = row.get("run_peak_allocated_bytes"), row.get("run_peak_reserved_bytes")
    retries = row.get("alloc_retries")
    return {
        "allocated <= budget": None if allocated is None or budget_bytes is None else allocated <= budget_bytes,
        "reserved <= budget": None if reserved is None or budget_bytes is None else reserved <= budget_bytes,
        "num_alloc_retries == 0": None if retries is None else retries == 0,
    }


def verdict(checks: dict[str, bool | None]) -> bool | None:
    """False if a check failed, True if every one held, None if one could not be measured and none failed."""
    if any(v is False for v in checks.values()):
        return False
    return None if any(v is None for v in checks.values()) else True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny Llama on the CPU (a smoke test of the path)")
    parser.add_argument("--budget", default=None, help="device budget (default 4GiB; --small: none)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default 2048; --small: 64)")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences a step (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON row (default: printed only)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plans with parameter offload fixed, trains, and returns the predicted and measured figures."""
    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    shape = SHAPES["tiny" if args.small else "1.1b"]
    seq_len = args.seq_len or (64 if args.small else 2048)
    budget = args.budget if args.budget is not None else (None if args.small else "4GiB")
    row: dict[str, Any] = {"shape": "tiny" if args.small else "1.1b", "budget": budget, "seq_len": seq_len,
                           "global_batch": args.global_batch, "environment": environment(device)}
    try:
        p = plan(meta_llama(shape, seq_len), budget=budget, seq_len=seq_len, global_batch_size=args.global_batch,
                 device=device.type, choices=Choices(offload_weights=True))
    except Exception as e:  # noqa: BLE001 - recorded in the row, which is the result
        row["error"] = _error(e)
        return row
    row.update(plan=p.settings.to_dict(), predicted_peak_bytes=p.peak_bytes, predicted_host_bytes=p.host_bytes,
               predicted_tokens_per_s=p.tokens_per_s, predicted_host_link=p.host_link.to_dict())
    retries = alloc_retries(device)
    try:
        row.update(run_settings(p.settings, shape, seq_len=seq_len, device=device, warmup=1, repeats=args.steps,
                                lr=1e-4))
    except Exception as e:  # noqa: BLE001 - an out-of-memory error is a result too
        row["error"] = _error(e)
    after = alloc_retries(device)
    row["alloc_retries"] = None if after is None or retries is None else after - retries
    row["budget_bytes"] = parse_bytes(budget) if budget is not None else None
    row["checks"] = budget_checks(row, row["budget_bytes"])
    row["fits"] = verdict(row["checks"]) if not row.get("error") else False
    return row


def _bytes(value: int | None) -> str:
    return format_bytes(value) if value is not None else "not measurable here"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    row = run(args)
    print(f"{row['shape']} with parameter offload, budget {row['budget']}: predicted peak "
          f"{format_bytes(row.get('predicted_peak_bytes') or 0)}; measured over the whole run: allocated "
          f"{_bytes(row.get('run_peak_allocated_bytes'))}, reserved {_bytes(row.get('run_peak_reserved_bytes'))}, "
          f"num_alloc_retries {_or_dash(row.get('alloc_retries'))}; predicted {row.get('predicted_tokens_per_s') or 0:,.0f}"
          f" tokens/s, measured {row.get('tokens_per_s') or 0:,.0f}"
          + (f"; error: {row['error']}" if row.get("error") else ""))
    for check, held in row.get("checks", {}).items():
        print(f"  {check}: {({None: 'not measured', True: 'yes', False: 'NO'})[held]}")
    if args.out is not None:
        args.out.write_text(json.dumps(row, indent=1))
    return 1 if row.get("error") or row.get("fits") is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
