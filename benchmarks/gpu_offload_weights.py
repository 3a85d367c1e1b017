"""Issue 20's GPU check of parameter offload: DESIGN.md's 1.1B Llama inside 4 GiB, its blocks' weights in host RAM.

``plan(...)`` with ``Choices(offload_weights=True)`` chooses the rest for the budget (the micro-batch, checkpointing,
the loss, the optimizer's moments); ``gpu_plan.run_settings`` builds the model on the device in the plan's weight
dtype, applies the plan (``apply_plan``: ``CPUOffloadOptimizer``, then ``WeightStreamer`` from its host master)
and trains a warm-up step and ``--steps`` timed steps on random tokens. The row sets the allocator's measured peaks
(over the timed steps, and over the whole run) beside the plan's predicted peak and tokens/s.

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
from memtrain.report import format_bytes  # noqa: E402


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
    try:
        row.update(run_settings(p.settings, shape, seq_len=seq_len, device=device, warmup=1, repeats=args.steps,
                                lr=1e-4))
    except Exception as e:  # noqa: BLE001 - an out-of-memory error is a result too
        row["error"] = _error(e)
    row["fits"] = (row.get("peak_allocated_bytes") is not None and budget is not None
                   and row["peak_allocated_bytes"] <= p.usable_bytes)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    row = run(args)
    measured = row.get("peak_allocated_bytes")
    print(f"{row['shape']} with parameter offload, budget {row['budget']}: predicted peak "
          f"{format_bytes(row.get('predicted_peak_bytes') or 0)}, measured "
          f"{format_bytes(measured) if measured is not None else 'not measurable here'}; predicted "
          f"{row.get('predicted_tokens_per_s') or 0:,.0f} tokens/s, measured {row.get('tokens_per_s') or 0:,.0f}"
          + (f"; error: {row['error']}" if row.get("error") else ""))
    if args.out is not None:
        args.out.write_text(json.dumps(row, indent=1))
    return 1 if row.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
