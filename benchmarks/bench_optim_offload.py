"""CPUOffloadOptimizer's CPU step against torch's fused AdamW on the CPU: parameter throughput, side by side.

The CPU step is what the GPU waits for at the end of an offloaded step (or hides behind the next one with
delayed_update), so it must run at the speed of torch's own fused kernel on the same tensors. Cases:

- ``torch fused AdamW``: ``torch.optim.AdamW(fused=True)`` on CPU tensors with their gradients set (the anchor);
- ``offload: CPU step``: CPUOffloadOptimizer's CPU step alone (buckets of views into its flat buffers, on its
  worker thread): the figure that must not be slower;
- ``offload: full step``: ``CPUOffloadOptimizer.step()`` with the "device" being the CPU, so it also copies the
  updated weights back into the parameters (on a GPU that copy is the host->device transfer, overlapped).

Run: ``.venv/bin/python benchmarks/bench_optim_offload.py [--params 16e6]``.

Two more cases time the work CPUOffloadOptimizer adds to the training loop's own thread, on a 500-tensor model
(250 ``Linear``s) where per-tensor overheads dominate (issue 13 items 5 and 6):

- ``--case landing``: a 4-micro-batch window through ``GradientAccumulator`` with clipping; the figure
  ``fwd_bwd_ms`` is the median forward+backward of one micro-batch (the gradient landings run in backward's hooks).
  Device AdamW is the baseline.
- ``--case delayed``: width 256 (16.5M parameters), bf16 device weights with ``delayed_update=True``; ``step_call_ms`` is the median time the
  ``step()`` call holds the loop's thread (it returns before the CPU step; it copies the previous step's weights).

Run: ``.venv/bin/python benchmarks/bench_optim_offload.py --case landing --repeats 30``. ``--against FILE`` adds
the same cases for the CPUOffloadOptimizer of another version of ``optim_offload.py``, interleaved (before/after):
``git show 54d082f:memtrain/optim_offload.py > /tmp/old_optim_offload.py`` then
``... --case landing --against /tmp/old_optim_offload.py``.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from runner import Case, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain.accumulation import GradientAccumulator  # noqa: E402
from memtrain.optim import CPUOffloadOptimizer  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def shapes(n_params: int) -> list[tuple[int, ...]]:
    """Transformer-like tensors (square and 2.75x MLP matrices, norm vectors) adding up to about n_params."""
    d = 1024
    block = [(d, d)] * 4 + [(int(2.75 * d), d)] * 3 + [(d,)] * 2
    per_block = sum(torch.Size(s).numel() for s in block)
    return block * max(1, round(n_params / per_block))


def make_params(n_params: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes(n_params)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def torch_fused(n_params: int):
    params = make_params(n_params)
    opt = torch.optim.AdamW(params, fused=True, **HYPER)
    return lambda: opt.step()


def offload(n_params: int, *, full: bool):
    params = make_params(n_params)
    grads = [p.grad for p in params]
    opt = CPUOffloadOptimizer(params, **HYPER)
    # Land the gradients as backward would: through the hooks (an identity graph gives each parameter its grad).
    for p in params:
        p.grad = None
    sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()
    if full:
        return lambda: opt.step()  # no zero_grad: every step reuses the landed host gradients

    # The host step alone: the gradients gathered once (they stay attached), each bucket stepped on the stepper's
    # worker with no copy back. The closure holds the optimizer: once collected, it stops its worker.
    opt.gather_gradients()

    def cpu_step() -> None:
        stepper = opt.stepper
        for bucket in stepper.buckets:
            stepper.worker.submit(stepper.step_bucket, bucket, None, False).result()

    return cpu_step


def many_tensors(dtype: torch.dtype = torch.float32, width: int = 64) -> torch.nn.Module:
    """500 parameter tensors (250 Linear(width, width) with biases): per-tensor costs dominate its step."""
    torch.manual_seed(0)
    layers = []
    for _ in range(250):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).to(dtype)


def load_other(path: str) -> type:
    """CPUOffloadOptimizer from another version of optim_offload.py (for before/after runs)."""
    spec = importlib.util.spec_from_file_location("other_optim_offload", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.CPUOffloadOptimizer


def landing_window(kind: str, cls: type = CPUOffloadOptimizer):
    """One 4-micro-batch window with clipping; figure: median forward+backward of one micro-batch."""
    model = many_tensors()
    if kind == "device":
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
    else:
        opt = cls(model.named_parameters(), **HYPER)
    acc = GradientAccumulator(model, opt, steps=4, max_grad_norm=1.0)
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    times: list[float] = []

    def window() -> dict[str, float]:
        for m in range(4):
            t0 = time.perf_counter()
            with acc.micro_batch(is_last=m == 3):
                acc.backward(model(x[m]).pow(2).sum(), reduction="sum", items=16)
            times.append(time.perf_counter() - t0)
        acc.step()
        return {"fwd_bwd_ms": statistics.median(times) * 1e3}

    return window


def delayed_bf16(cls: type = CPUOffloadOptimizer):
    """bf16 device weights, delayed_update=True; figure: median time the step() call holds the loop's thread."""
    model = many_tensors(torch.bfloat16, width=256)  # 16.5M parameters
    opt = cls(model.named_parameters(), delayed_update=True, **HYPER)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    times: list[float] = []

    def iteration() -> dict[str, float]:
        model(x).float().pow(2).sum().backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        return {"step_call_ms": statistics.median(times) * 1e3}

    return iteration


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=16e6, help="parameters to step (default 16e6)")
    parser.add_argument("--case", choices=["throughput", "landing", "delayed"], default="throughput")
    parser.add_argument("--against", help="another optim_offload.py whose CPUOffloadOptimizer runs beside this one")
    args = parser.parse_args()
    if args.case != "throughput":
        other = load_other(args.against) if args.against else None
        if args.case == "landing":
            cases = [Case("device AdamW window", lambda: landing_window("device"), notes="4 micro-batches + clip"),
                     Case("offload window", lambda: landing_window("offload"), notes="4 micro-batches + clip")]
            if other is not None:
                cases.append(Case("offload window (--against)", lambda: landing_window("offload", other)))
        else:
            cases = [Case("delayed bf16 iteration", delayed_bf16, notes="fwd+bwd+step, 500 bf16 tensors")]
            if other is not None:
                cases.append(Case("delayed bf16 iteration (--against)", lambda: delayed_bf16(other)))
        run_side_by_side(cases, title=f"optim_offload_{args.case}", repeats=args.repeats, warmup=args.warmup,
                         device="cpu", json_path=args.out)
        print_json_if_asked(args, args.out or f"bench-results/optim_offload_{args.case}.json")
        return
    n = int(args.params)
    numel = sum(torch.Size(s).numel() for s in shapes(n))
    cases = [
        Case("torch fused AdamW", lambda: torch_fused(n), notes="torch.optim.AdamW(fused=True) on the CPU"),
        Case("offload: CPU step", lambda: offload(n, full=False), notes="the host step alone"),
        Case("offload: full step", lambda: offload(n, full=True), notes="+ copy back into the CPU 'device' params"),
    ]
    results = run_side_by_side(cases, title="optim_offload", repeats=args.repeats, warmup=args.warmup,
                               device="cpu", json_path=args.out)
    for r in results:
        if r.median_s:
            print(f"  {r.name}: {numel / r.median_s / 1e9:.2f} G params/s ({numel / 1e6:.1f} M params)")
    print_json_if_asked(args, args.out or "bench-results/optim_offload.json")


if __name__ == "__main__":
    main()
