"""memtrain.optim: state precision, step-in-backward, partial offload, the builder and the byte model.

Parity first (the same parameters as torch AdamW through GradientAccumulator: clipping, accumulation, fp16
scaler, LR schedules), then the bytes (exact, on the CPU), then bad input.
"""

from __future__ import annotations

import copy
import io
import sys

import pytest
import torch
from torch import nn

from memtrain.accumulation import GradientAccumulator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.measure import optimizer_state_bytes
from memtrain.models import GPT
from memtrain.optim import (
    BF16StateAdamW,
    LeanAdamW,
    build_optimizer,
    cpu_step_rate,
    moments_of,
    offloaded_mask,
    optimizer_memory,
)
from memtrain.optim_offload import CPUOffloadOptimizer

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def make_model(seed: int = 0) -> nn.Module:
    # Linear(64, 128)'s weight has 8,192 elements: int8 quantises it (tensors under 4,096 keep fp32 moments).
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6 + i % 3, 16, generator=g) * 2, torch.randn(6 + i % 3, 4, generator=g)) for i in range(n)]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def train(options: dict | None, *, steps: int = 6, micro: int = 3, max_norm: float | None = None,
          scaler_scale: float | None = None, schedule: bool = False, overflow_at: int | None = None):
    """Trains make_model() through GradientAccumulator (sum-reduced, variable lengths); options=None: torch AdamW."""
    model = make_model()
    if options is None:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    else:
        opt = build_optimizer(model.named_parameters(), **HYPER, **options)
    scaler = None
    if scaler_scale is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale)
        if options is not None:
            opt.grad_scaler = scaler  # what build_optimizer(grad_scaler=...) sets
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    acc = GradientAccumulator(model, opt, steps=micro, max_grad_norm=max_norm, scaler=scaler, scheduler=scheduler)
    data = batches(steps * micro)
    results = []
    for step in range(steps):
        for m in range(micro):
            x, y = data[step * micro + m]
            with acc.micro_batch(is_last=m == micro - 1):
                loss = ((model(x) - y) ** 2).sum()
                if step == overflow_at:
                    loss = loss * 1e38  # overflows the scaled gradients: the step must be skipped
                acc.backward(loss, reduction="sum", items=x.shape[0])
        results.append(acc.step())
    return model, opt, results


def train_lagged_clipping(max_norm: float, *, steps: int = 6, micro: int = 3):
    """torch AdamW in a plain loop with lagged clipping (what step-in-backward does in one backward pass): window
    t's normalised gradient is multiplied by min(1, max_norm / (norm of window t-1 + 1e-6)); the first window is
    not clipped. Returns the model and each window's norm before clipping."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = batches(steps * micro)
    previous, norms = None, []
    for step in range(steps):
        items = 0
        for m in range(micro):
            x, y = data[step * micro + m]
            ((model(x) - y) ** 2).sum().backward()
            items += x.shape[0]
        grads = [p.grad for p in model.parameters()]
        torch._foreach_mul_(grads, 1 / items)
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if previous is not None:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (previous + 1e-6), max=1.0))
        opt.step()
        scheduler.step()
        opt.zero_grad()
        previous = norm
        norms.append(float(norm))
    return model, norms


# -- parity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"offload_fraction": 0.5}, {"offload_fraction": 1.0}],
                         ids=["device", "half-offloaded", "offloaded"])
@pytest.mark.parametrize("max_norm", [None, 0.5], ids=["no-clip", "clip"])
def test_fp32_matches_torch_adamw_with_accumulation_clipping_and_schedule(options, max_norm) -> None:
    ref, _, ref_results = train(None, max_norm=max_norm, schedule=True)
    ours, _, results = train(options, max_norm=max_norm, schedule=True)
    if max_norm is not None:
        clipped = sum(r.grad_norm > max_norm for r in ref_results)
        assert clipped >= 5, f"clipping must be active to be tested: {clipped} of 6 steps clipped"
    for r, o in zip(ref_results, results, strict=True):
        assert abs(r.grad_norm - o.grad_norm) <= 1e-6 * r.grad_norm, f"norm {o.grad_norm} vs torch {r.grad_norm}"
    assert max_diff(ref, ours) <= 1e-6, f"max abs difference {max_diff(ref, ours):.3e} (tolerance 1e-6)"


@pytest.mark.parametrize("offload_fraction", [0.0, 0.5], ids=["device", "half-offloaded"])
def test_step_in_backward_equals_the_ordinary_step(offload_fraction) -> None:
    """With accumulation (3 micro-batches) and an LR schedule, one backward pass per micro-batch: without active
    clipping the ordinary step within 1e-6; with clipping active, torch AdamW with lagged clipping (the previous
    window's norm; none for the first) within 1e-6, each window's norm too."""
    options = {"step_in_backward": True, "offload_fraction": offload_fraction}
    for max_norm in (None, 1e9, 0.5):
        if max_norm == 0.5:
            ref, ref_norms = train_lagged_clipping(max_norm)
            assert sum(n > max_norm for n in ref_norms) >= 5, "clipping must be active"
        else:
            ref, _, ref_results = train(None, max_norm=max_norm, schedule=True)
            ref_norms = [r.grad_norm for r in ref_results]
        ours, opt, results = train(options, max_norm=max_norm, schedule=True)
        norms = [(a, o.grad_norm) for a, o in zip(ref_norms, results, strict=True)]
        assert all(abs(a - b) <= 1e-6 * a for a, b in norms), f"max_norm={max_norm}: norms {norms}"
        diff = max_diff(ref, ours)
        assert diff <= 1e-6, f"max_norm={max_norm}: max abs difference {diff:.3e} (tolerance 1e-6)"


def test_step_in_backward_frees_each_gradient_as_it_steps() -> None:
    """The live device gradient bytes at the backward's peak stay within the largest block's parameters (the
    ordinary step holds the whole model's gradients), measured with a hook that runs before the optimizer's."""
    torch.manual_seed(0)
    results = {}
    for step_in_backward in (False, True):
        model = GPT.from_preset("gpt-tiny")
        params = list(model.parameters())
        live = []

        def count(_: torch.Tensor, params: list = params, live: list = live) -> None:
            live.append(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))

        for p in params:
            p.register_post_accumulate_grad_hook(count)  # registered first: runs before the optimizer's hook
        opt = build_optimizer(model.named_parameters(), lr=1e-3, step_in_backward=step_in_backward)
        x = torch.randint(0, 256, (2, 32))
        before = [p.detach().clone() for p in params]
        model(x, x).backward()
        if step_in_backward:
            assert all(p.grad is None for p in params), "a gradient outlived its step"
            assert all(not torch.equal(a, b) for a, b in zip(before, params, strict=True)), "a parameter did not step"
        opt.step()
        opt.zero_grad()
        results[step_in_backward] = max(live)
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    assert results[True] <= block, f"{results[True]} live gradient bytes at the peak, largest block {block}"
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    assert results[False] == everything, f"the ordinary step holds {results[False]} of {everything} bytes"


def test_step_in_backward_with_fp16_scaler_skips_overflow_like_torch() -> None:
    """One backward pass: the inf flag, kept on the device, stops every parameter once the overflowing gradients
    land (here every gradient overflows), as torch's skipped step; within 1e-6 of torch AdamW without clipping.
    With clipping (lagged) the same windows are skipped and the skipped one changes nothing."""
    for options in ({"step_in_backward": True}, {"step_in_backward": True, "offload_fraction": 0.5}):
        ref, _, ref_results = train(None, scaler_scale=2.0**10, overflow_at=2)
        ours, _, results = train(options, scaler_scale=2.0**10, overflow_at=2)
        assert [r.skipped for r in results] == [r.skipped for r in ref_results] == [i == 2 for i in range(6)]
        assert max_diff(ref, ours) <= 1e-6, f"{options}: max abs difference {max_diff(ref, ours):.3e}"
        clipped, _, clipped_results = train(options, scaler_scale=2.0**10, max_norm=0.5, overflow_at=2, steps=3)
        before, _, _ = train(options, scaler_scale=2.0**10, max_norm=0.5, steps=2)
        assert [r.skipped for r in clipped_results] == [False, False, True]
        assert max_diff(before, clipped) == 0.0, "the overflowing window changed the weights"


def test_partial_offload_with_fp16_scaler_matches_torch() -> None:
    ref, _, ref_results = train(None, scaler_scale=2.0**10, max_norm=0.5, overflow_at=3)
    ours, _, results = train({"offload_fraction": 0.5}, scaler_scale=2.0**10, max_norm=0.5, overflow_at=3)
    assert [r.skipped for r in results] == [r.skipped for r in ref_results] == [i == 3 for i in range(6)]
    assert max_diff(ref, ours) <= 1e-6, f"max abs difference {max_diff(ref, ours):.3e}"


def _gpt_eval_loss(state_precision: str, steps: int) -> float:
    from memtrain.data import builtin_corpus

    torch.manual_seed(0)
    gpt = GPT.from_preset("gpt-tiny")
    train_set, val = builtin_corpus(gpt.config.seq_len, max_bytes=2**20)
    opt = build_optimizer(gpt.named_parameters(), lr=3e-3, weight_decay=0.1, state_precision=state_precision)
    acc = GradientAccumulator(gpt, opt, steps=1, max_grad_norm=1.0)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        x, y = (torch.stack(t) for t in zip(*(train_set[int(i)] for i in order[step * 8:(step + 1) * 8]),
                                            strict=True))
        with acc.micro_batch(is_last=True):
            acc.backward(gpt(x, y), reduction="mean")
        acc.step()
    with torch.no_grad():
        x, y = (torch.stack(t) for t in zip(*(val[i] for i in range(64)), strict=True))
        return gpt.eval()(x, y).item()


def test_bf16_and_int8_states_train_the_gpt_like_fp32() -> None:
    """gpt-tiny on the built-in corpus, 30 steps of 8 windows: eval loss within 1% of fp32 AdamW (the 300-step
    figure: benchmarks/bench_optim_state.py)."""
    base = _gpt_eval_loss("fp32", 30)
    for precision in ("bf16", "int8"):
        loss = _gpt_eval_loss(precision, 30)
        assert abs(loss / base - 1) <= 0.01, f"{precision}: eval loss {loss:.4f} vs fp32 {base:.4f}"


def test_bf16_rounding_keeps_the_second_moment_moving() -> None:
    """beta2=0.999 changes the second moment by 0.1% a step, below bf16's half ulp: round-to-nearest would freeze
    it; stochastic rounding follows fp32 AdamW's on average."""
    p32, p16 = (torch.zeros(4096, requires_grad=True) for _ in range(2))
    ref = torch.optim.AdamW([p32], lr=0.0, betas=(0.9, 0.999))
    ours = BF16StateAdamW([p16], lr=0.0, betas=(0.9, 0.999))
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        grad = 1.0 + 0.5 * torch.randn(4096, generator=g)
        p32.grad, p16.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    v32, v16 = ref.state[p32]["exp_avg_sq"], ours.state[p16]["exp_avg_sq"].float()
    rel = ((v16.mean() - v32.mean()) / v32.mean()).abs().item()
    assert rel < 0.01, f"bf16 second moment mean {v16.mean():.4f} vs fp32 {v32.mean():.4f} ({rel:.2%})"
    nearest = v32.bfloat16().float()  # what round-to-nearest would hold were it tracking: must not be frozen
    assert (v16 - nearest).abs().max() < 0.1, "the bf16 moments drifted away from fp32's"


# -- state_dict ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("offload_fraction", [0.0, 1.0], ids=["device", "offloaded"])
def test_resume_continues_bit_identically(precision, offload_fraction) -> None:
    options = {"state_precision": precision, "offload_fraction": offload_fraction}
    straight, opt, _ = train(options, steps=6)
    first, opt1, _ = train(options, steps=3)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["optim"]["state"]) <= {n for n, _ in first.named_parameters()}, "state is keyed by name"
    resumed = make_model(seed=5)
    resumed.load_state_dict(saved["model"])
    opt2 = build_optimizer(resumed.named_parameters(), **HYPER, **options)
    opt2.load_state_dict(saved["optim"])
    acc = GradientAccumulator(resumed, opt2, steps=3)
    data = batches(18)
    for step in range(3, 6):
        for m in range(3):
            x, y = data[step * 3 + m]
            with acc.micro_batch(is_last=m == 2):
                acc.backward(((resumed(x) - y) ** 2).sum(), reduction="sum", items=x.shape[0])
        acc.step()
    assert max_diff(straight, resumed) == 0.0, f"{precision}: resumed differs by {max_diff(straight, resumed):.3e}"


@pytest.mark.parametrize("source,target", [("fp32", "int8"), ("int8", "fp32"), ("bf16", "fp32"), ("fp32", "bf16"),
                                           ("int8", "bf16")])
def test_a_state_loads_into_another_precision_converted(source, target) -> None:
    _, opt, _ = train({"state_precision": source}, steps=2)
    saved = opt.state_dict()
    model = make_model()
    other = build_optimizer(model.named_parameters(), **HYPER, state_precision=target, offload_fraction=0.5)
    other.load_state_dict(saved)
    sd = other.state_dict()
    assert sd["state_precision"] == target
    tolerance = {"fp32": 0.0, "bf16": 2**-7, "int8": 0.05}
    for name, entry in saved["state"].items():
        step, m, v = moments_of(entry)
        step2, m2, v2 = moments_of(sd["state"][name])
        assert step2 == step == 2.0
        scale = max(m.abs().max().item(), 1e-30)
        err = (m2 - m).abs().max().item() / scale
        assert err <= max(tolerance[source], tolerance[target]) + 1e-7, f"{name}: exp_avg off by {err:.3e}"


def test_a_state_of_another_model_is_refused() -> None:
    _, opt, _ = train({}, steps=1)
    saved = opt.state_dict()
    saved["state"]["9.weight"] = saved["state"].pop("4.weight")
    model = make_model()
    with pytest.raises(ConfigError, match="'9.weight' names no parameter"):
        build_optimizer(model.named_parameters(), **HYPER).load_state_dict(saved)
    bad = {"state": {"0.weight": {"momentum_buffer": torch.zeros(64, 16)}}, "param_groups": saved["param_groups"]}
    with pytest.raises(ConfigError, match="not AdamW's"):
        build_optimizer(make_model().named_parameters(), **HYPER).load_state_dict(bad)


# -- bytes --------------------------------------------------------------------------------------------------
CONFIGS = [dict(state_precision=p, offload_fraction=f, step_in_backward=s)
           for p in ("fp32", "bf16", "int8") for f in (0.0, 0.3, 1.0) for s in (False, True) if not (f == 1.0 and s)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_byte_model_equals_what_measure_counts(config) -> None:
    model, opt, _ = train(config, steps=1)
    predicted = optimizer_memory([(p.numel(), p.dtype) for p in model.parameters()], device_type="cpu", **config)
    assert predicted.state_bytes == optimizer_state_bytes(opt), (
        f"predicted {predicted.state_bytes} bytes of state, measured {optimizer_state_bytes(opt)}")
    host = opt._host
    if host is None:
        assert predicted.host_bytes == 0 and predicted.offloaded_params == 0
        return
    buffers = {}
    for slot in host._slots:
        for t in (slot.master, *slot.grads, *(t for t in (slot.cast, slot.stage) if t is not None)):
            buffers[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    host_state = sum(v.untyped_storage().nbytes() for v in {id(v): v for e in host.state.values()
                                                            for v in e.values() if torch.is_tensor(v)}.values())
    assert predicted.host_state_bytes == host_state
    assert predicted.host_bytes == host_state + sum(buffers.values()), "host RAM: masters, gradients, casts, stages, state"
    assert predicted.offloaded_params == len(host._slots)


def test_int8_state_is_at_most_2_1_bytes_per_parameter() -> None:
    torch.manual_seed(0)
    gpt = GPT.from_preset("gpt-mini")  # 0.85M parameters; bias and norm vectors keep fp32 moments
    opt = build_optimizer(gpt.named_parameters(), lr=1e-3, state_precision="int8")
    x = torch.randint(0, 256, (1, 16))
    gpt(x, x).backward()
    opt.step()
    numel = sum(p.numel() for p in gpt.parameters())
    measured = optimizer_state_bytes(opt) / numel
    assert measured <= 2.1, f"{measured:.3f} bytes of int8 state per parameter (gpt-mini)"
    # A Llama-7B shape (hidden 4096, intermediate 11008, 32 layers, vocabulary 32000), from the byte model.
    h, i, v = 4096, 11008, 32000
    layer = [(h * h, torch.float32)] * 4 + [(h * i, torch.float32)] * 3 + [(h, torch.float32)] * 2
    llama = [(v * h, torch.float32)] + layer * 32 + [(h, torch.float32), (v * h, torch.float32)]
    per_param = optimizer_memory(llama, state_precision="int8").state_bytes / sum(n for n, _ in llama)
    assert per_param <= 2.1, f"{per_param:.4f} bytes per parameter for the 7B shape"
    assert optimizer_memory(llama, state_precision="bf16").state_bytes / sum(n for n, _ in llama) <= 4.001


def test_offloaded_parameters_are_the_last_ones() -> None:
    assert offloaded_mask([10, 10, 10, 10], 0.5) == [False, False, True, True]
    assert offloaded_mask([10, 10, 10, 10], 0.3) == [False, False, True, True]  # at least the fraction
    assert offloaded_mask([10, 10, 10, 10], 0.0) == [False] * 4
    assert offloaded_mask([10, 10, 10, 10], 1.0) == [True] * 4


def test_frozen_parameters_are_skipped() -> None:
    model = make_model()
    model[0].requires_grad_(False)  # e.g. LoRA's frozen base
    opt = build_optimizer(model.named_parameters(), **HYPER, offload_fraction=0.5)
    names = opt.param_groups[0]["param_names"]
    assert names == ["2.weight", "2.bias", "4.weight", "4.bias"], names


def test_cpu_step_rate_is_measured_for_each_precision() -> None:
    for precision in ("fp32", "bf16", "int8"):
        rate = cpu_step_rate(precision, n_params=1 << 14, repeats=1)
        assert rate > 0 and rate == rate, f"{precision}: {rate}"


def test_wrapper_subclass_state_counts_the_tensors_it_holds() -> None:
    """A state held as a tensor subclass wrapping others (torchao's 8-bit state, DTensor) counts its inner
    tensors, not its apparent dtype (TwoTensor stands in: a subclass holding two fp32 tensors)."""
    from torch.testing._internal.two_tensor import TwoTensor

    p = nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p]["wrapped"] = TwoTensor(torch.zeros(10), torch.zeros(10))
    assert optimizer_state_bytes(opt) == 80


def test_dtensor_state_counts_its_local_shard() -> None:
    """FSDP2 keeps optimizer state as DTensors, whose flattening also names their (non-tensor) device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        p = nn.Parameter(torch.zeros(10))
        opt = torch.optim.SGD([p], lr=0.1)
        opt.state[p]["exp_avg"] = distribute_tensor(torch.zeros(10), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert optimizer_state_bytes(opt) == 40
    finally:
        dist.destroy_process_group()


# -- the explicit boundary and bad input --------------------------------------------------------------------
def test_step_in_backward_plain_loop_and_explicit_boundary() -> None:
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = build_optimizer(ours.named_parameters(), **HYPER, step_in_backward=True)
    for x, y in batches(4):
        ((ref(x) - y) ** 2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ((ours(x) - y) ** 2).sum().backward()  # steps every parameter, frees every gradient
        opt.step()  # the boundary: checks a backward stepped, reports the norm
        opt.zero_grad()
    assert max_diff(ref, ours) == 0.0
    with pytest.raises(MemtrainError, match="no backward since the last step"):
        opt.step()
    with pytest.raises(MemtrainError, match="clip_grad_norm_ on a step-in-backward optimizer"):
        opt.clip_grad_norm_(1.0)
    # Clipping is given before backward (lagged: the last window's norm clips this one); still one plain backward.
    x, y = batches(1)[0]
    opt.prepare_backward(max_norm=1e-3)
    ((ours(x) - y) ** 2).sum().backward()
    opt.step()
    assert opt.last_grad_norm.item() > 1e-3  # the norm before clipping


def test_unknown_state_precision() -> None:
    with pytest.raises(ConfigError, match=r"state_precision='fp8' is not one of \['fp32', 'bf16', 'int8'\]"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, state_precision="fp8")
    with pytest.raises(ConfigError, match="state_precision"):
        optimizer_memory([(10, torch.float32)], state_precision="int4")


def test_int8_without_bitsandbytes_names_the_extra_and_the_fallback(monkeypatch) -> None:
    import memtrain.optim as optim

    monkeypatch.setattr(optim, "_ADAMW8BIT", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"memtrain\[lowbit\].*state_precision='bf16'"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, state_precision="int8")


def test_int8_on_a_device_without_a_kernel_names_the_fallback() -> None:
    model = make_model().to("meta")
    with pytest.raises(ConfigError, match=r"'meta' device.*state_precision='bf16'"):
        build_optimizer(model.named_parameters(), lr=1e-3, state_precision="int8")


def test_step_in_backward_refuses_what_cannot_step_per_parameter() -> None:
    with pytest.raises(ConfigError, match="LBFGS.*cannot step alone"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, step_in_backward=True,
                        optimizer_class=torch.optim.LBFGS)
    with pytest.raises(ConfigError, match="world_size=2"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, step_in_backward=True, world_size=2)
    plain = build_optimizer(make_model().named_parameters(), lr=1e-3)
    with pytest.raises(MemtrainError, match="step_in_backward=False"):
        plain.prepare_backward(last=True)


def test_step_in_backward_under_running_ranks_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    with pytest.raises(ConfigError, match="world_size=4: DDP averages gradients after the hooks"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, step_in_backward=True)


def test_other_bad_input() -> None:
    with pytest.raises(ConfigError, match=r"offload_fraction=1.5 must be a number in \[0, 1\]"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, offload_fraction=1.5)
    with pytest.raises(ConfigError, match="no parameter that requires grad"):
        build_optimizer(make_model().requires_grad_(False).named_parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match="not fp32.*offload_fraction=1.0"):
        build_optimizer(make_model().bfloat16().named_parameters(), lr=1e-3)
    # bf16 weights are fine offloaded: the host keeps their fp32 master.
    opt = build_optimizer(make_model().bfloat16().named_parameters(), lr=1e-3, offload_fraction=1.0)
    assert isinstance(opt, LeanAdamW) and isinstance(opt._host, CPUOffloadOptimizer)
    opt.close()


def test_lr_scheduler_drives_every_part() -> None:
    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, offload_fraction=0.5, step_in_backward=True)
    frozen = copy.deepcopy(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s == 0 else 0.0)
    x, y = batches(1)[0]
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = copy.deepcopy(model)
    ((model(x) - y) ** 2).sum().backward()  # the device half steps here, the host half in step()
    opt.step()
    assert max_diff(before, model) == 0.0, "lr=0 from the scheduler still moved weights"
    assert max_diff(frozen, model) > 0.0


def test_step_in_backward_steps_a_parameter_used_only_in_earlier_micro_batches() -> None:
    """A parameter whose gradient comes from the first micro-batch only (no hook fires for it in the last
    backward) still steps, at step(), and its norm counts: the same result as the ordinary step."""
    def run(options: dict | None, max_norm: float | None) -> nn.Module:
        torch.manual_seed(0)
        model = nn.ModuleDict({"body": nn.Linear(16, 4), "side": nn.Linear(16, 4)})
        if options is None:
            opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
        else:
            opt = build_optimizer(model.named_parameters(), **HYPER, **options)
        acc = GradientAccumulator(model, opt, steps=2, max_grad_norm=max_norm)
        for x, y in batches(6):
            for m in range(2):
                with acc.micro_batch(is_last=m == 1):
                    out = model["body"](x) + (model["side"](x) if m == 0 else 0)
                    acc.backward(((out - y) ** 2).sum(), reduction="sum", items=x.shape[0])
            acc.step()
        return model

    for max_norm in (None, 1e9):
        ref, ours = run(None, max_norm), run({"step_in_backward": True}, max_norm)
        assert max_diff(ref, ours) <= 1e-6, f"max_norm={max_norm}: {max_diff(ref, ours):.3e}"


def test_step_in_backward_refuses_a_non_finite_window_before_stepping() -> None:
    """One pass: the first non-finite gradient to land sets the device flag before its parameter steps, so no
    parameter steps (every gradient is inf here); the accumulator raises."""
    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, step_in_backward=True)
    acc = GradientAccumulator(model, opt, steps=1, max_grad_norm=1.0)
    before = copy.deepcopy(model)
    x, y = batches(1)[0]
    with acc.micro_batch(is_last=True):
        acc.backward(((model(x) - y) ** 2).sum() * float("inf"), reduction="sum", items=x.shape[0])
    with pytest.raises(MemtrainError, match="no later one did \\(the weights hold no nan\\)"):
        acc.step()
    assert max_diff(before, model) == 0.0, "a parameter stepped on a non-finite gradient"
    with acc.micro_batch(is_last=True):  # the next window trains as usual
        acc.backward(((model(x) - y) ** 2).sum(), reduction="sum", items=x.shape[0])
    assert acc.step().step == 1 and max_diff(before, model) > 0.0


def test_step_in_backward_with_clipping_under_checkpointing_and_torchs_chunked_loss() -> None:
    """One backward per micro-batch: checkpointed blocks and torch's native chunked loss (whose backward may run
    only once: the old two-pass backward raised "chunked backward called twice") give the weights of the plain
    model, lagged clipping active."""
    from memtrain import apply_checkpointing
    from memtrain.loss import apply_chunked_loss

    def run(step_in_backward: bool, checkpointed: bool) -> nn.Module:
        torch.manual_seed(0)
        gpt = GPT.from_preset("gpt-tiny")
        if checkpointed:
            apply_checkpointing(gpt)
            apply_chunked_loss(gpt, chunk_tokens=16)
        opt = build_optimizer(gpt.named_parameters(), lr=1e-3, step_in_backward=step_in_backward)
        acc = GradientAccumulator(gpt, opt, steps=2, max_grad_norm=0.5)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for m in range(2):
                x = torch.randint(0, 256, (2, 32), generator=g)
                with acc.micro_batch(is_last=m == 1):
                    acc.backward(gpt(x, x), reduction="mean")
            acc.step()
        return gpt

    ref, ours = run(True, False), run(True, True)
    # 1e-5: the chunked loss's gradients equal the whole-logits loss's within float rounding, not bit for bit.
    assert max_diff(ref, ours) <= 1e-5, f"max abs difference {max_diff(ref, ours):.3e} (tolerance 1e-5)"


# -- step-in-backward from the CLI and the planner ----------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["--global-batch-size", "8"]], ids=["one-micro-batch", "accumulation"])
def test_cli_trains_with_step_in_backward_and_the_default_clipping(tmp_path, capsys, extra) -> None:
    """The default --grad-clip 1.0 with torch's native chunked loss (the old two-pass backward raised "chunked
    backward called twice"); with accumulation the parameters step in the last micro-batch's backward (it was
    refused, naming torchrun in a one-process run)."""
    from memtrain.cli import main

    code = main(["train", "--model", "gpt-tiny", "--micro-batch-size", "4", "--max-steps", "2", "--step-in-backward",
                 "--no-progress", "--out", str(tmp_path / "run"), *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "torchrun" not in err


def test_planner_keeps_an_asked_for_step_in_backward_with_accumulation() -> None:
    from memtrain.planner import Fixed, plan

    torch.manual_seed(0)
    p = plan(GPT.from_preset("gpt-tiny"), budget=None, seq_len=32, global_batch_size=8, device="cpu",
             precision="fp32", micro_batch_size=4, fixed=Fixed(optimizer="device", step_in_backward=True))
    assert (p.settings.step_in_backward, p.settings.accumulation) == (True, 2), p.summary()
    with pytest.raises(ConfigError, match="no set-up can be built") as info:
        plan(GPT.from_preset("gpt-tiny"), budget=None, seq_len=32, global_batch_size=8, device="cpu",
             precision="fp32", fixed=Fixed(optimizer="device", step_in_backward=True, offload_fraction=0.5))
    assert "world_size" not in str(info.value) and "cannot accumulate" not in str(info.value), str(info.value)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
def test_a_partial_offload_normalises_unscales_and_clips_without_a_pass_over_host_gradients(fp16) -> None:
    """LeanAdamW's host part through GradientAccumulator (3 micro-batches, clipping active): between the last
    backward and the host step no aten op reads or writes a host gradient buffer (the old code multiplied them
    by 1/items, unscaled them and multiplied them by the clip coefficient, a pass each)."""
    from helpers import Touches

    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, offload_fraction=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if fp16 else None
    opt.grad_scaler = scaler
    acc = GradientAccumulator(model, opt, steps=3, max_grad_norm=0.5, scaler=scaler)
    storages = {s.grads[0].untyped_storage().data_ptr() for s in opt._host._slots}
    seen: list[list[str]] = []
    step = opt._host.step

    def counted_until_the_host_step(*args, **kwargs):
        seen.append(list(touches.ops))  # what touched host gradients before the host step began
        return step(*args, **kwargs)

    opt._host.step = counted_until_the_host_step
    data = batches(3)
    for m, (x, y) in enumerate(data):
        with acc.micro_batch(is_last=m == 2):
            acc.backward(((model(x) - y) ** 2).sum(), reduction="sum", items=x.shape[0])
    opt._host._flush_landings()
    for future in opt._host._landings:
        future.result()  # the landings (copies, adds, norms) are backward's work, done on the worker
    with Touches(storages) as touches:
        result = acc.step()
    assert seen == [[]], f"ops on host gradients before the host step: {seen}"
    assert result.grad_norm > 0.5, "clipping must be active to be tested"
