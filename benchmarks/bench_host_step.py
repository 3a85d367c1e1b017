"""The host optimizer step (issue 29): each moment precision's fused host kernel beside torch's fused fp32 AdamW, the
multi-tensor path it replaced, and the machine's copy bandwidth, side by side in one process.

An offloaded optimizer's CPU step is memory-bound: per parameter it moves 28 bytes with fp32 moments (torch's fused
AdamW: p, g, m, v read, p, m, v written), 20 with bf16 moments, 16 with bitsandbytes' int8 layout, 14 for pure bf16
with bf16 moments (22 with fp32 moments). Each case steps ``--params`` parameters in 4 tensors on ``--threads`` threads; repetitions are
interleaved so that the machine's drift hits every case alike. The summary prints parameters per second, the ratio to
torch's fused fp32 AdamW (issue 29's targets on 2 threads: bf16 moments >= 1.0x, pure bf16 >= 1.2x, int8 >= 0.8x)
and the bytes per second each case moves by that count.

Run: ``memtrain bench host_step`` (8.4M parameters, the issue's size, which the L3 cache of a large server may hold)
or ``memtrain bench host_step -- --params 64M`` (beyond it: the memory-bound figure).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (runner), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from runner import Case, Result, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain.errors import ConfigError  # noqa: E402
from memtrain.optim import BF16StateAdamW, PureBF16AdamW, host_kernels  # noqa: E402
from memtrain.optim.moments import adamw_8bit_class  # noqa: E402

# Bytes a step moves per parameter (read and written), by case: what "GB/s" in the summary divides by.
BYTES = {"fp32": 28, "bf16": 20, "int8": 16, "pure": 14, "pure-fp32": 22}


def parse_count(text: str) -> int:
    """'8.4M', '64M', '1.5G', '8388608' -> a count."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def _tensors(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n // 4, generator=g).to(dtype) for _ in range(4)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
    return params


def _stepper(make, n: int, dtype: torch.dtype, *, fused: bool):
    def setup():
        opt = make(_tensors(n, dtype))

        def step():
            if fused:
                opt.step()
            else:
                with host_kernels.multi_tensor_path():
                    opt.step()
        return step
    return setup


def _copy(n: int):
    def setup():
        src, dst = torch.randn(n), torch.empty(n)

        def step():
            dst.copy_(src)
        return step
    return setup


def cases(n: int) -> list[Case]:
    fp32 = torch.float32
    out = [
        Case("torch AdamW fused, fp32 moments", _stepper(lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), n,
                                                         fp32, fused=True), notes="fp32"),
        Case("bf16 moments, fused kernel", _stepper(lambda ps: BF16StateAdamW(ps, lr=1e-4), n, fp32, fused=True),
             notes="bf16"),
        Case("bf16 moments, multi-tensor ops (before)",
             _stepper(lambda ps: BF16StateAdamW(ps, lr=1e-4), n, fp32, fused=False), notes="bf16"),
        Case("pure bf16, bf16 moments, fused kernel",
             _stepper(lambda ps: PureBF16AdamW(ps, lr=1e-4), n, torch.bfloat16, fused=True), notes="pure"),
        Case("pure bf16, bf16 moments, multi-tensor ops (before)",
             _stepper(lambda ps: PureBF16AdamW(ps, lr=1e-4), n, torch.bfloat16, fused=False), notes="pure"),
        Case("pure bf16, fp32 moments, fused kernel",
             _stepper(lambda ps: PureBF16AdamW(ps, lr=1e-4, state_precision="fp32"), n, torch.bfloat16, fused=True),
             notes="pure-fp32"),
    ]
    try:
        int8 = adamw_8bit_class("cpu")
        out += [Case("int8 moments, fused kernel", _stepper(lambda ps: int8(ps, lr=1e-4), n, fp32, fused=True),
                     notes="int8"),
                Case("int8 moments, bitsandbytes' CPU step (before)",
                     _stepper(lambda ps: int8(ps, lr=1e-4), n, fp32, fused=False), notes="int8")]
    except ConfigError as e:
        print(f"int8 cases skipped: {e}")
    out.append(Case("copy: one fp32 tensor of the same count (bandwidth)", _copy(n), notes="copy"))
    return out


def summary(results: list[Result], n: int) -> str:
    base = results[0].median_s
    lines = [f"{'case':<55} {'Mparam/s':>9} {'x fused fp32':>13} {'GB/s moved':>11}"]
    for r in results:
        if r.median_s is None:
            lines.append(f"{r.name:<55} {r.error}")
            continue
        moved = 8 if r.notes == "copy" else BYTES[r.notes]
        rate = n / r.median_s
        lines.append(f"{r.name:<55} {rate / 1e6:>9.1f} {base / r.median_s:>12.2f}x {rate * moved / 1e9:>11.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--params", default="8.4M", help="parameters stepped (4 tensors), e.g. 8.4M or 64M")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every case")
    parser.set_defaults(repeats=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = parse_count(args.params) // 16 * 16
    fused, why = host_kernels.kernel_status()
    print(f"host kernels: {why}; {n:,} parameters, {args.threads} threads")
    out = args.out or "bench-results/host_step.json"
    results = run_side_by_side(cases(n), title="host_step", repeats=args.repeats, warmup=args.warmup,
                               device="cpu", json_path=out)
    print(summary(results, n))
    print_json_if_asked(args, out)


if __name__ == "__main__":
    main()
