"""memtrain.optim.moments: BF16StateAdamW's multi-tensor step, and the aten ops per parameter tensor of every state precision's step.

The GPU-speed contract counts, on the CPU, the aten ops an optimizer step dispatches (``aten_ops_per_param``): on
a GPU each one is a kernel launch of several microseconds, so a step whose count grows with the number of
parameter tensors is launch-bound on models of many small tensors. Then parity (torch's fp32 AdamW, a reference
stochastic rounding), the bounded fp32 copies, and GradScaler's fused protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import memtrain.optim as optim
import memtrain.optim.moments as moments
from memtrain.errors import MemtrainError
from memtrain.measure import KernelOps, cpu_allocation_peak_bytes
from memtrain.optim import BF16StateAdamW, CPUOffloadOptimizer, build_optimizer, host_kernels
from memtrain.optim.moments import split_passes


@dataclass(frozen=True)
class StepOps:
    """The aten ops of one optimizer step, as a ``TorchDispatchMode`` sees them.

    Attributes:
        tensors: parameter tensors the step updated (those with a gradient).
        kernels: ops that may launch a kernel on a GPU, by name: every op but views, allocations and profiler
            markers (``_local_scalar_dense``, a host read, is counted too).
        views: aliasing ops (views, slices, ``detach``): metadata only, no kernel.
        others: allocations and profiler markers.
    """

    tensors: int
    kernels: dict[str, int]
    views: int
    others: int

    @property
    def per_tensor(self) -> float:
        """Kernel ops per parameter tensor per step: the contract's figure."""
        return sum(self.kernels.values()) / self.tensors


def aten_ops_per_param(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], model: nn.Module,
                       inputs: torch.Tensor) -> StepOps:
    """The aten ops of one optimizer step, per parameter tensor: the second step of ``make_optimizer(model)`` on
    the gradients of ``model(inputs).square().mean()`` (the first step creates the state).

    For a ``CPUOffloadOptimizer`` (alone, or inside ``build_optimizer(..., offload_fraction=1.0)``) only the host
    step is counted: its wrapped optimizers' ``step()``, on the worker thread that runs them (not the gradient
    copies, the casts or the copies back).

    Example:
        >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])  # 20 parameter tensors
        >>> aten_ops_per_param(lambda m: torch.optim.AdamW(m.parameters(), fused=True), model,
        ...                    torch.randn(8, 64)).per_tensor
        0.1
    """
    opt = make_optimizer(model)
    host = opt if isinstance(opt, CPUOffloadOptimizer) else getattr(opt, "_host", None)
    mode, counting = KernelOps(), threading.Event()
    if host is not None:
        for bucket in host._buckets:
            def step_counted(step=bucket.inner.step):
                if not counting.is_set():
                    return step()
                with mode:
                    return step()
            bucket.inner.step = step_counted
    for count in (False, True):
        opt.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        if count and host is None:
            with mode:
                opt.step()
        else:
            if count:
                counting.set()
            opt.step()
    counting.clear()
    tensors = sum(p.requires_grad for p in model.parameters())  # each gets a gradient here
    return StepOps(tensors=tensors, kernels=dict(mode.kernels), views=mode.views, others=mode.others)


def mlp(layers: int = 10, width: int = 64, seed: int = 0) -> nn.Module:
    """``2 * layers`` parameter tensors; the weights (``width**2`` = 4,096 elements) are large enough for
    bitsandbytes to keep 8-bit moments."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def _inputs(width: int = 64) -> torch.Tensor:
    return torch.randn(8, width, generator=torch.Generator().manual_seed(1))


def fused_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def state_precision(precision: str, offload_fraction: float = 0.0) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """A factory of ``build_optimizer(..., state_precision=precision, offload_fraction=...)``."""
    def make(model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model.named_parameters(), lr=1e-3, state_precision=precision,
                               offload_fraction=offload_fraction)
    return make


# -- the contract: aten ops per parameter tensor per step ------------------------------------------------------
def test_the_count_sees_torchs_reference_steps() -> None:
    """Fused AdamW: one step-counter add and one kernel for all 20 tensors; the for-loop: several per tensor."""
    fused = aten_ops_per_param(fused_adamw, mlp(), _inputs())
    assert fused.tensors == 20
    assert fused.kernels == {"aten._foreach_add_.Scalar": 1, "aten._fused_adamw_.default": 1}, fused.kernels
    loop = aten_ops_per_param(lambda m: torch.optim.AdamW(m.parameters(), foreach=False), mlp(), _inputs())
    assert loop.per_tensor >= 5, loop


def test_bf16_step_ops_do_not_grow_with_the_parameter_tensors() -> None:
    """BF16StateAdamW's multi-tensor path (the GPU's) steps all tensors of a pass together: one step-counter add per
    step and five multi-tensor ops per pass (copy in, fused AdamW, noise, mask, copy out), so 20 and 40 tensors cost
    the same and the figure per tensor is within 3x fused fp32 AdamW's (6 ops to its 2: the kernel cannot read bf16
    moments)."""
    fused = aten_ops_per_param(fused_adamw, mlp(), _inputs())
    with host_kernels.multi_tensor_path():
        ops = aten_ops_per_param(state_precision("bf16"), mlp(), _inputs())
        more = aten_ops_per_param(state_precision("bf16"), mlp(layers=20), _inputs())
    assert sum(more.kernels.values()) == sum(ops.kernels.values()) == 6, (ops.kernels, more.kernels)
    assert ops.per_tensor <= 3 * fused.per_tensor, f"bf16 {ops.per_tensor:.2f} vs fused {fused.per_tensor:.2f}"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("offload_fraction", [0.0, 1.0], ids=["device", "host-step"])
def test_each_state_precision_steps_in_few_ops_per_tensor(precision, offload_fraction) -> None:
    """Per parameter tensor, on 20 tensors: fp32 (torch's fused kernel, on the device or the host) within 2x
    fused AdamW; bf16 within 3x (see above); int8 (bitsandbytes' AdamW8bit) one kernel per tensor: its kernels
    take one tensor each, 10x fused here, which only a multi-tensor 8-bit kernel would remove."""
    if precision == "int8":
        pytest.importorskip("bitsandbytes")
    fused = aten_ops_per_param(fused_adamw, mlp(), _inputs()).per_tensor
    ops = aten_ops_per_param(state_precision(precision, offload_fraction), mlp(), _inputs())
    assert ops.tensors == 20
    bound = {"fp32": 2 * fused, "bf16": 3 * fused, "int8": 1.0}[precision]
    assert ops.per_tensor <= bound + 1e-9, f"{precision}: {ops.per_tensor:.2f} ops per tensor > {bound:.2f}: " \
                                           f"{ops.kernels}"


def test_bf16_passes_are_bounded_by_bf16_chunk(monkeypatch) -> None:
    """With BF16_CHUNK elements per pass, a step allocates one fp32 scratch of 2 x 4 x BF16_CHUNK bytes (both
    moments of one pass) and no more (the noise table is made once), and runs 1 + 5 ops per pass: 20 tensors of 41,600 elements in 41 passes
    of 1,024 (weights split across passes, biases packed together)."""
    monkeypatch.setitem(moments.BF16_CHUNK, "cpu", 1024)
    monkeypatch.setattr(host_kernels, "_off", True)  # the multi-tensor path (a GPU's) on the CPU
    model = mlp()
    total = sum(p.numel() for p in model.parameters())
    ops = aten_ops_per_param(state_precision("bf16"), model, _inputs())
    passes = -(-total // 1024)
    assert sum(ops.kernels.values()) == 1 + 5 * passes, ops.kernels
    opt = BF16StateAdamW(model.parameters(), lr=1e-3)
    model(_inputs()).square().mean().backward()
    opt.step()  # creates the state and the noise table
    peak = cpu_allocation_peak_bytes(opt.step)
    bound = 2 * 4 * 1024 + 64  # and a few 0-d tensors (scalars the kernels take)
    assert peak <= bound, f"the step allocated {peak} bytes at its peak, over {bound}"


# -- parity ----------------------------------------------------------------------------------------------------
class _ReferenceBF16AdamW(torch.optim.Optimizer):
    """The previous implementation's algorithm, with a generator's noise: per parameter, torch's fused AdamW on
    fp32 copies of the bf16 moments, then stochastic rounding with uniform 16-bit noise."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=1e-8))
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p, dtype=torch.bfloat16),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.bfloat16))
                m32, v32 = state["exp_avg"].float(), state["exp_avg_sq"].float()
                state["step"] += 1
                torch._fused_adamw_([p], [p.grad], [m32], [v32], [], [state["step"]], lr=group["lr"],
                                    beta1=group["betas"][0], beta2=group["betas"][1],
                                    weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                    maximize=False)
                for dst, x in ((state["exp_avg"], m32), (state["exp_avg_sq"], v32)):
                    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=self.generator)
                    x.view(torch.int32).add_(noise).bitwise_and_(-65536)
                    dst.copy_(x)


def _train(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], steps: int,
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small regression, full batch, seeded: every optimizer sees the same gradients at step 0."""
    model = mlp(layers=3, width=32)
    opt = make(list(model.parameters()))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model, opt


def _distance(a: nn.Module, b: nn.Module) -> tuple[float, float]:
    """(max, mean) absolute parameter difference."""
    d = torch.cat([(p - q).abs().flatten() for p, q in zip(a.parameters(), b.parameters(), strict=True)])
    return d.max().item(), d.mean().item()


def _second_moment_mean(opt: torch.optim.Optimizer) -> float:
    return torch.cat([s["exp_avg_sq"].float().flatten() for s in opt.state.values()]).mean().item()


def _three(hyper: dict, steps: int) -> tuple[tuple[nn.Module, torch.optim.Optimizer], ...]:
    """fp32 AdamW (fused), ours and the reference, trained alike."""
    return (_train(lambda ps: torch.optim.AdamW(ps, fused=True, **hyper), steps),
            _train(lambda ps: BF16StateAdamW(ps, **hyper), steps),
            _train(lambda ps: _ReferenceBF16AdamW(ps, **hyper), steps))


def test_bf16_follows_fp32_adamw_within_the_moments_rounding() -> None:
    """10 steps at lr 1e-2 against torch's fp32 AdamW: bf16 moments (8 bits of mantissa, stochastically rounded)
    change each update by at most about 1% (2**-7 of m, half that of sqrt(v)), so the parameters stay within
    10 x lr x 2**-6 of fp32's, as the previous algorithm's (the reference) do."""
    steps, hyper = 10, dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    (fp32, _), (ours, _), (ref, _) = _three(hyper, steps)
    tolerance = steps * hyper["lr"] * 2**-6
    for name, model in (("ours", ours), ("reference", ref)):
        worst, _ = _distance(model, fp32)
        assert worst <= tolerance, f"{name}: max |p - p_fp32| {worst:.3e} > {tolerance:.3e}"


def test_bf16_rounding_error_has_the_statistics_of_the_previous_algorithm() -> None:
    """300 steps at lr 1e-3: the mean distance to fp32 AdamW's parameters is within 2x of the reference rounding's
    (the previous algorithm, a generator's independent noise), and the second moments' mean within 1% of fp32's
    (no drift: the rounding is unbiased)."""
    steps, hyper = 300, dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1)
    (fp32, fp32_opt), (ours, ours_opt), (ref, ref_opt) = _three(hyper, steps)
    _, mean_ours = _distance(ours, fp32)
    _, mean_ref = _distance(ref, fp32)
    assert 0.5 <= mean_ours / mean_ref <= 2.0, f"mean |p - p_fp32|: ours {mean_ours:.3e}, reference {mean_ref:.3e}"
    v32 = _second_moment_mean(fp32_opt)
    for name, opt in (("ours", ours_opt), ("reference", ref_opt)):
        v16 = _second_moment_mean(opt)
        assert abs(v16 / v32 - 1) < 0.01, f"{name}: mean exp_avg_sq {v16:.4e} vs fp32 {v32:.4e}"


# -- GradScaler, bad input -------------------------------------------------------------------------------------
def test_bf16_takes_gradscalers_scale_and_inf_flag_like_fused_adamw() -> None:
    """GradScaler hands grad_scale and found_inf to the step (as to torch's fused AdamW) instead of unscaling and
    checking on the host: the kernel unscales (a power of two: bitwise the unscaled run) and an overflowing step
    leaves weights, moments and step counts as they were."""
    plain, scaled = mlp(layers=2), mlp(layers=2)
    opt_plain = BF16StateAdamW(plain.parameters(), lr=1e-2)
    opt_scaled = BF16StateAdamW(scaled.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = _inputs()
    for _ in range(3):
        opt_plain.zero_grad(set_to_none=True)
        opt_scaled.zero_grad(set_to_none=True)
        plain(x).square().mean().backward()
        opt_plain.step()
        scaler.scale(scaled(x).square().mean()).backward()
        scaler.step(opt_scaled)
        scaler.update()
    assert _distance(plain, scaled)[0] == 0.0
    before = {k: v.clone() for k, v in opt_scaled.state[next(scaled.parameters())].items() if torch.is_tensor(v)}
    weights = [p.detach().clone() for p in scaled.parameters()]
    opt_scaled.zero_grad(set_to_none=True)
    scaler.scale(scaled(x).square().mean() * float("inf")).backward()
    scaler.step(opt_scaled)
    scaler.update()
    assert all(torch.equal(p, w) for p, w in zip(scaled.parameters(), weights, strict=True))
    after = opt_scaled.state[next(scaled.parameters())]
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a skipped step changed the state"
    assert scaler.get_scale() == 2.0**9


@pytest.mark.parametrize("bad", ["bf16-parameter", "transposed"])
def test_bf16_refuses_what_its_flat_fp32_passes_cannot_step(bad) -> None:
    if bad == "bf16-parameter":
        p = nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
        match = r"steps fp32 parameters .* got a torch.bfloat16 parameter.*To resolve this error"
    else:
        p = nn.Parameter(torch.randn(4, 6).t())
        match = r"contiguous parameters.*shape \(6, 4\) with strides \(1, 6\).*To resolve this error"
    p.grad = torch.ones_like(p)
    with pytest.raises(MemtrainError, match=match):
        BF16StateAdamW([p]).step()


def test_passes_split_tensors_where_the_budget_ends() -> None:
    assert split_passes([3, 10, 2], 4, align=1) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)], [(1, 5, 9)],
                                               [(1, 9, 10), (2, 0, 2)]]
    assert split_passes([0, 4], 4, align=1) == [[(1, 0, 4)]]
    assert split_passes([], 4) == []
    # Aligned: a segment's slot is its length rounded up to 16, so cuts fall on multiples of 16.
    assert split_passes([20, 40, 5], 32, align=16) == [[(0, 0, 20)], [(1, 0, 32)], [(1, 32, 40), (2, 0, 5)]]
    assert split_passes([40], 40, align=16) == [[(0, 0, 32)], [(0, 32, 40)]]  # a budget of 40 counts as 32


def test_bf16_state_dict_round_trip_keeps_bf16_moments_and_resumes_bit_identically(monkeypatch) -> None:
    """torch's Optimizer.load_state_dict casts state to the parameters' fp32: the moments must come back bf16
    (4 bytes per parameter), and a run resumed after 3 of 6 steps equals the straight one bit for bit, with
    passes that split tensors (BF16_CHUNK of 1,000 elements)."""
    monkeypatch.setitem(moments.BF16_CHUNK, "cpu", 1000)
    x = _inputs(32)

    def run(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

    straight = mlp(layers=3, width=32)
    run(straight, BF16StateAdamW(straight.parameters(), lr=1e-2, seed=3), 6)
    first = mlp(layers=3, width=32)
    opt = BF16StateAdamW(first.parameters(), lr=1e-2, seed=3)
    run(first, opt, 3)
    saved = opt.state_dict()
    resumed = mlp(layers=3, width=32, seed=9)
    resumed.load_state_dict(first.state_dict())
    opt2 = BF16StateAdamW(resumed.parameters(), lr=1e-2, seed=3)
    opt2.load_state_dict(saved)
    dtypes = {s[k].dtype for s in opt2.state.values() for k in ("exp_avg", "exp_avg_sq")}
    assert dtypes == {torch.bfloat16}, f"moments loaded as {dtypes}"
    run(resumed, opt2, 3)
    assert _distance(straight, resumed)[0] == 0.0, f"resumed differs by {_distance(straight, resumed)[0]:.3e}"


def test_bf16_loads_torch_adamws_state() -> None:
    """An fp32 AdamW state (no rounding counters) loads rounded to nearest and steps on."""
    model = mlp(layers=2)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(_inputs()).square().mean().backward()
    ref.step()
    opt = BF16StateAdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(ref.state_dict())
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[p]["exp_avg"].bfloat16())
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[p]["exp_avg_sq"].bfloat16())
    assert sorted(s["salt"] for s in opt.state.values()) == list(range(4))
    opt.step()
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}


def test_optimizer_memory_bounds_the_bf16_steps_transient_bytes_over_many_small_tensors(monkeypatch):
    """optimizer_memory's device_step_temp_bytes is an upper bound of what a BF16StateAdamW step allocates: one
    pass holds fp32 copies of every tensor's moments (not of the largest tensor's only, as per-tensor chunks did)
    and the first step builds the rounding-noise table."""
    from memtrain.measure import cpu_allocation_peak_bytes

    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(1000, generator=g)) for _ in range(40)]
    opt = optim.BF16StateAdamW(params, lr=1e-3)
    monkeypatch.setattr(host_kernels, "_off", True)  # the multi-tensor path (a GPU's) on the CPU
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    predicted = optim.optimizer_memory([(p.numel(), p.dtype) for p in params], state_precision="bf16",
                                       device_type="cpu").device_step_temp_bytes
    state = sum(2 * 2 * p.numel() + 64 for p in params)  # the moments (bf16) and counters the first step creates
    first = cpu_allocation_peak_bytes(opt.step) - state
    second = cpu_allocation_peak_bytes(opt.step)
    assert 8 * 40 * 1000 <= second <= predicted and first <= predicted, (first, second, predicted)
