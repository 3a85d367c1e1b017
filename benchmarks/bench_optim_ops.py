"""Aten ops per parameter tensor per optimizer step, and the CPU step time, of each state precision's AdamW beside
torch's fused AdamW (the GPU-speed contract's figure; on a GPU each op is a kernel launch).

- The ops: ``aten_ops_per_param`` (tests/test_optim_moments.py) on 20 parameter tensors (10 x Linear(64, 64)), for
  torch's fused and foreach AdamW, then ``build_optimizer`` with fp32, bf16 and int8 moments on the device and
  their CPUOffloadOptimizer host step (``offload_fraction=1.0``, the host step only).
- The time: one step of torch's fused AdamW, torch's foreach AdamW, BF16StateAdamW and (when bitsandbytes is
  installed) bitsandbytes' AdamW8bit, median of ``--repeats`` interleaved, on ``--tensors`` tensors holding
  ``--params`` parameters in all (defaults: 200 tensors, 2**22 parameters).

Run: ``.venv/bin/python benchmarks/bench_optim_ops.py --repeats 20 --threads 1`` (add ``--tensors 4`` for a few
large tensors: the bandwidth-bound case).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from runner import Case, common_args, print_json_if_asked, run_side_by_side  # noqa: E402
from test_optim_moments import aten_ops_per_param, fused_adamw, mlp, state_precision  # noqa: E402

from memtrain.errors import ConfigError  # noqa: E402
from memtrain.optim import BF16StateAdamW, adamw_8bit_class  # noqa: E402


def ops_table() -> list[tuple[str, float, dict[str, int]]]:
    """(name, kernel ops per tensor, ops by name) on 20 parameter tensors."""
    inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    factories = {"torch AdamW fused": fused_adamw,
                 "torch AdamW foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)}
    for precision in ("fp32", "bf16", "int8"):
        factories[f"{precision} moments"] = state_precision(precision)
        factories[f"{precision} moments, host step"] = state_precision(precision, 1.0)
    rows = []
    for name, make in factories.items():
        try:
            ops = aten_ops_per_param(make, mlp(), inputs)
        except ConfigError as e:  # int8 without bitsandbytes
            print(f"{name}: skipped ({str(e).split('.')[0]})")
            continue
        rows.append((name, ops.per_tensor, ops.kernels))
    return rows


def step_case(name: str, make, tensors: int, params: int) -> Case:
    def setup():
        g = torch.Generator().manual_seed(0)
        ps = [torch.randn(params // tensors, generator=g) for _ in range(tensors)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt = make(ps)

        def step():
            opt.step()
        return step
    return Case(name, setup)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--params", type=float, default=2**22)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads: 1 gives stable figures on a loaded "
                        "machine (multi-threaded kernels wait for descheduled threads)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = ops_table()
    fused = rows[0][1]
    print("aten kernel ops per parameter tensor per step, 20 tensors (views, allocations, profiler marks apart)")
    for name, per_tensor, kernels in rows:
        print(f"  {name:34s} {per_tensor:6.2f}  ({per_tensor / fused:5.1f}x fused)  {sum(kernels.values())} ops")
    cases = [step_case("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), args.tensors,
                       int(args.params)),
             step_case("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True), args.tensors,
                       int(args.params)),
             step_case("BF16StateAdamW", lambda ps: BF16StateAdamW(ps, lr=1e-4), args.tensors, int(args.params))]
    try:
        cases.append(step_case("bitsandbytes AdamW8bit", lambda ps: adamw_8bit_class("cpu")(ps, lr=1e-4),
                               args.tensors, int(args.params)))
    except ConfigError:
        pass
    path = ROOT / "bench-results" / "optim_ops.json" if args.out is None else Path(args.out)
    run_side_by_side(cases, title=f"optimizer step, {args.tensors} tensors, {int(args.params)} parameters",
                     repeats=args.repeats, warmup=args.warmup, device="cpu", json_path=path)
    print_json_if_asked(args, path)


if __name__ == "__main__":
    main()
