"""memtrain.optim.host_kernels: the fused host AdamW steps (bf16 moments, pure bf16, bitsandbytes' 8-bit layout).

Each kernel is checked against the path it replaced (the multi-tensor ops a GPU still runs, bitsandbytes' own CPU
step), against torch's fp32 AdamW over several steps, for bitwise independence of the thread count (the rounding
noise is counter-based), for what it dispatches (no op per tensor), and for its fallback when no compiler is there.
Times are measured by benchmarks/bench_host_step.py, never here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.device import simulate
from memtrain.optim import BF16StateAdamW, PureBF16AdamW, host_kernels
from memtrain.optim.moments import adamw_8bit_class

# Only an explicit MEMTRAIN_HOST_KERNELS=0 skips these: on a machine with g++ (make test installs ninja) a kernel that
# does not build fails test_the_kernels_build_here.
pytestmark = pytest.mark.skipif(os.environ.get("MEMTRAIN_HOST_KERNELS") == "0", reason="MEMTRAIN_HOST_KERNELS=0")

# Sizes over two threads' grain (the kernels split 32,768 elements at a time), a tail that is no multiple of 16 or of
# the 8-bit block (256), and a tensor of fewer than 4,096 elements (fp32 moments under int8, as bitsandbytes keeps).
SIZES = (70_001, 4_099, 300)


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def _train(make, dtype: torch.dtype = torch.float32, steps: int = 6, fused: bool = True, lr: float = 1e-3):
    params = _params(dtype)
    opt = make(params, lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(dtype)
        if fused:
            opt.step()
        else:
            with host_kernels.multi_tensor_path():
                opt.step()
    return params, opt


def _bf16(ps, lr):
    return BF16StateAdamW(ps, lr=lr, weight_decay=0.1)


def _pure(ps, lr):
    return PureBF16AdamW(ps, lr=lr, weight_decay=0.1)


def _fp32(ps, lr):
    return torch.optim.AdamW(ps, lr=lr, weight_decay=0.1)


def _int8(ps, lr):
    pytest.importorskip("bitsandbytes")
    return adamw_8bit_class("cpu")(ps, lr=lr, weight_decay=0.1)


def _apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where two bf16 tensors differ by more than one bf16 step of the larger (2**-7 of it: neighbours or equal), or
    by 1e-9 near zero (a first moment crossing zero, 0 on one side and 1e-11 on the other)."""
    a, b = a.detach().float(), b.detach().float()
    return (a - b).abs() > 2**-7 * torch.maximum(a.abs(), b.abs()) + 1e-9


def test_the_kernels_build_here() -> None:
    ok, why = host_kernels.kernel_status()
    assert ok, why


def test_bf16_moments_fused_follows_the_multi_tensor_path() -> None:
    """6 steps at lr 1e-3, same seeds and rounding keys: the kernel's fp32 arithmetic differs from torch's fused
    AdamW in the last bit (no fused multiply-add, sqrt(v) times 1 / sqrt(1 - beta2^t)), which sends a moment to the
    neighbouring bf16 value now and then (under 1% of the elements), so a weight moves by up to 2**-7 of an update
    (lr) more or less per step: within 6 x lr x 2**-7."""
    (fused, fo), (ref, ro) = _train(_bf16), _train(_bf16, fused=False)
    for a, b in zip(fused, ref, strict=True):
        assert (a - b).abs().max() <= 6 * 1e-3 * 2**-7
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = fo.state[a][key], ro.state[b][key]
            assert not _apart(x, y).any() and (x != y).float().mean() < 0.01, key


def test_bf16_moments_fused_within_1e_4_of_fp32_adamw_over_6_steps() -> None:
    """Issue 29's parity: bf16 moments (stochastically rounded) against torch's fp32 AdamW, 6 steps at lr 1e-3."""
    (ours, _), (fp32, _) = _train(_bf16), _train(_fp32)
    worst = max((a - b).abs().max().item() for a, b in zip(ours, fp32, strict=True))
    assert worst <= 1e-4, worst


def test_pure_bf16_fused_follows_the_multi_tensor_path() -> None:
    """Pure bf16 with bf16 moments: the weights and moments of the kernel and of the multi-tensor path (same noise
    keys) are at most one bf16 step apart, and equal in over 99% of the elements."""
    (fused, fo), (ref, ro) = _train(_pure, torch.bfloat16), _train(_pure, torch.bfloat16, fused=False)
    for a, b in zip(fused, ref, strict=True):
        for x, y in ((a.detach(), b.detach()), (fo.state[a]["exp_avg"], ro.state[b]["exp_avg"]),
                     (fo.state[a]["exp_avg_sq"], ro.state[b]["exp_avg_sq"])):
            assert not _apart(x, y).any() and (x != y).float().mean() < 0.01


def test_pure_bf16_fused_keeps_non_finite_weights() -> None:
    """An inf weight stays inf and a NaN stays NaN (no rounding noise on them), as the multi-tensor path's guard."""
    p = torch.nn.Parameter(torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0] * 8, dtype=torch.bfloat16))
    p.grad = torch.full_like(p, 1e-3)
    PureBF16AdamW([p], lr=1e-3).step()
    head = p.detach()[:4].float()
    assert head[0] == float("inf") and head[1] == float("-inf") and head[2].isnan() and head[3].isfinite()


def test_int8_code_tables_give_the_nearest_code() -> None:
    """The kernel's encoding (a table by the top 16 bits, one comparison) picks the nearest code of bitsandbytes'
    signed and unsigned dynamic maps for every value tried, as torch.bucketize over the midpoints does."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(0)
    for signed in (True, False):
        code = bnbf.create_dynamic_map(signed=signed)
        bounds, table = host_kernels.code_tables(code)
        x = torch.rand(200_000, generator=g) ** 6
        x = torch.cat([x * torch.randn(x.shape, generator=g).sign() if signed else x,
                       torch.tensor([0.0, 1.0, -1.0 if signed else 0.5]), (code[1:] + code[:-1]) / 2])
        entry = table[(x.view(torch.int32) >> 16) & 0xFFFF]
        k = entry & 0xFFFFFFFF
        above = (entry >> 32).to(torch.int32).view(torch.float32)  # the midpoint above code k, as the kernel reads it
        assert torch.equal(above, bounds[k])
        k = k + (x > above).long()
        assert torch.equal(k, torch.bucketize(x, bounds[:-1]))


def test_int8_fused_encodes_each_moment_at_least_as_near_as_bitsandbytes() -> None:
    """One step from the same state: the same absmax and weights (within fp32 rounding), and every moment decoded
    from our codes is as near to its fp32 value as bitsandbytes' CPU encoder's (which is not always the nearest
    code: it sends some small values to a farther one)."""
    (ours, oo), (bnb, bo) = _train(_int8, steps=1), _train(_int8, steps=1, fused=False)
    a, b = ours[0], bnb[0]
    assert (a - b).abs().max() <= 1e-6
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(a.shape, generator=g) * 1e-2
    for i, exact in ((1, 0.1 * grad), (2, 0.001 * grad * grad)):
        so, sb = oo.state[a], bo.state[b]
        assert torch.allclose(so[f"absmax{i}"], sb[f"absmax{i}"], rtol=1e-6, atol=0)
        scale = so[f"absmax{i}"].repeat_interleave(256)[:a.numel()]
        ours_err = (so[f"qmap{i}"][so[f"state{i}"].long()] * scale - exact).abs()
        bnb_err = (sb[f"qmap{i}"][sb[f"state{i}"].long()] * scale - exact).abs()
        assert (ours_err <= bnb_err + 1e-6 * scale).all()


def test_int8_fused_follows_fp32_adamw_as_near_as_bitsandbytes() -> None:
    """6 steps at lr 1e-2: the fused 8-bit step's distance to torch's fp32 AdamW is within 1.25x of bitsandbytes'
    own CPU step's (both quantise the moments block-wise to 8 bits)."""
    (ours, _), (bnb, _), (fp32, _) = (_train(_int8, lr=1e-2), _train(_int8, lr=1e-2, fused=False),
                                     _train(_fp32, lr=1e-2))
    ours_d = sum((a - f).abs().sum().item() for a, f in zip(ours, fp32, strict=True))
    bnb_d = sum((b - f).abs().sum().item() for b, f in zip(bnb, fp32, strict=True))
    assert ours_d <= 1.25 * bnb_d, (ours_d, bnb_d)


@pytest.mark.parametrize("make,dtype", [(_bf16, torch.float32), (_pure, torch.bfloat16), (_int8, torch.float32)],
                         ids=["bf16", "pure-bf16", "int8"])
def test_fused_steps_are_bitwise_the_same_on_any_thread_count(make, dtype) -> None:
    """Counter-based noise and per-element (per-block for int8) work: 1 thread and 2 give the same bits."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _train(make, dtype, steps=3)
        torch.set_num_threads(2)
        two, _ = _train(make, dtype, steps=3)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if not name.startswith("_record_function"):  # the profiler's marks around Optimizer.step
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make,dtype", [(_bf16, torch.float32), (_pure, torch.bfloat16)], ids=["bf16", "pure-bf16"])
def test_a_fused_step_dispatches_no_op_per_tensor(make, dtype) -> None:
    """The step counters' one multi-tensor add, then one kernel call per tensor outside torch's dispatcher: the
    count does not grow with the tensors (the multi-tensor path's is 1 + 5 per pass)."""
    params = _params(dtype)
    opt = make(params, 1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # creates the state
    with _Ops() as mode:
        opt.step()
    assert mode.ops == ["_foreach_add_"], mode.ops


def test_the_simulated_devices_tensors_take_the_gpus_path() -> None:
    """On the simulated accelerator, device tensors step through the multi-tensor ops (as on a GPU, where the
    memory model counts their scratch); host tensors beside them take the kernel."""
    with simulate("64MiB", lag=None) as acc:
        on_device = acc.place(torch.zeros(1024))
        on_host = torch.zeros(1024)
        assert not host_kernels.runs_fused(on_device) and host_kernels.runs_fused(on_host)


def test_a_failed_build_warns_once_and_the_multi_tensor_path_steps(monkeypatch, caplog) -> None:
    """No compiler: one warning naming the reason and the fix, then every step takes the multi-tensor path, with the
    same result as that path always gives."""
    def no_compiler():
        raise RuntimeError("Error building extension: g++: error: command not found")

    monkeypatch.setattr(host_kernels, "_module", None)
    monkeypatch.setattr(host_kernels, "_reason", None)
    monkeypatch.setattr(host_kernels, "_build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="memtrain.optim.host_kernels"):
        (after, _) = _train(_bf16, steps=2)
        ok, why = host_kernels.kernel_status()
    assert not ok and "g++: error: command not found" in why and "pip install ninja" in why
    assert len([r for r in caplog.records if "could not be built" in r.message]) == 1
    monkeypatch.setattr(host_kernels, "_reason", "off")
    (ref, _) = _train(_bf16, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(after, ref, strict=True))


def test_memtrain_host_kernels_0_turns_them_off_with_its_reason() -> None:
    env = dict(os.environ, MEMTRAIN_HOST_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", "from memtrain.optim import host_kernels as h; "
                          "print(h.kernel_status(), h.runs_fused(__import__('torch').zeros(4)), h.expected())"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert "False" in out and "MEMTRAIN_HOST_KERNELS=0" in out and out.strip().endswith("False False")


def test_a_kernel_releases_the_gil_while_it_runs() -> None:
    """An offloaded optimizer steps on its worker thread: the training loop's thread must run meanwhile (the kernel
    releases the GIL, as torch's ops do). Deterministic, with no timing: under a switch interval of 100 s no thread
    is made to yield, so the main thread runs while the worker is in the kernel only if the kernel released the GIL;
    then it turns its loop 1,000 times before the worker can take the GIL back and say it is done. Holding the GIL,
    the worker finishes first and the loop never turns."""
    import threading

    ts = [torch.zeros(1 << 24, dtype=torch.bfloat16) for _ in range(4)]
    step = torch.tensor(1.0)
    kernel = host_kernels.kernels().adamw_lean_
    inside, done = threading.Event(), threading.Event()

    def work():
        inside.set()
        kernel(*ts, step, 1e-3, 0.9, 0.999, 1e-8, 0.0, None, None, 0, 1, 2)
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        inside.wait()
        turns = 0
        while turns < 1000 and not done.is_set():
            turns += 1
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert turns == 1000, turns


def test_the_host_step_benchmark_prints_every_case_beside_torchs(tmp_path) -> None:
    """benchmarks/bench_host_step.py (memtrain bench host_step), as a smoke run: every case ran (no error column),
    each with its ratio to torch's fused fp32 AdamW."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_host_step.py"), "--params", "64K",
                           "--repeats", "1", "--out", str(tmp_path / "out.json")], capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = done.stdout.split("GB/s moved", 1)[1].strip().splitlines()
    assert len(summary) == 9 and all("x " in line and "failed" not in line for line in summary), done.stdout


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_is_waited_for(tmp_path, caplog):
    """torch's extension build waits, forever, for its folder's lock to go: a process killed while building left
    one that hung every later run (a suite under torch 2.11 waited 20 minutes). A lock older than any build is
    removed, saying so; a fresh one (a build under way) stays."""
    from memtrain.optim import host_kernels

    lock = tmp_path / "lock"
    lock.touch()
    host_kernels._clear_stale_lock(lock)
    assert lock.exists()  # a build under way: torch waits for it
    old = host_kernels.STALE_LOCK_S + 60
    os.utime(lock, (lock.stat().st_atime - old, lock.stat().st_mtime - old))
    with caplog.at_level(logging.WARNING, logger="memtrain"):
        host_kernels._clear_stale_lock(lock)
    assert not lock.exists() and "did not finish" in caplog.text, caplog.text
    host_kernels._clear_stale_lock(lock)  # none: nothing to do
