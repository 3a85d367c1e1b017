"""CPUOffloadOptimizer's CPU step against torch's fused AdamW on the CPU: parameter throughput, side by side.

The CPU step is what the GPU waits for at the end of an offloaded step (or hides behind the next one with
delayed_update), so it must run at the speed of torch's own fused kernel on the same tensors. Cases:

- ``torch fused AdamW``: ``torch.optim.AdamW(fused=True)`` on CPU tensors with their gradients set (the anchor);
- ``offload: CPU step``: CPUOffloadOptimizer's CPU step alone (buckets of views into its flat buffers, on its
  worker thread): the figure that must not be slower;
- ``offload: full step``: ``CPUOffloadOptimizer.step()`` with the "device" being the CPU, so it also copies the
  updated weights back into the parameters (on a GPU that copy is the host->device transfer, overlapped).

Run: ``.venv/bin/python benchmarks/bench_optim_offload.py [--params 16e6]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from runner import Case, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain.optim_offload import CPUOffloadOptimizer  # noqa: E402

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

    def cpu_step() -> None:
        opt._gather()
        for bucket in opt._buckets:
            opt._worker.submit(opt._step_bucket, bucket, None, False).result()
        opt._gathered = False

    return cpu_step


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=16e6, help="parameters to step (default 16e6)")
    args = parser.parse_args()
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
