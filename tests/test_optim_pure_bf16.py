"""memtrain.optim.pure_bf16: stochastic rounding is unbiased and lands on a neighbouring bf16 value; one step equals
AdamW computed in fp64 on the same bf16 weights within one bf16 ulp; the device, step-in-backward and offloaded
variants agree and resume bit-identically; the byte model equals what measure counts; what cannot combine is
refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from memtrain.errors import ConfigError, MemtrainError
from memtrain.measure import optimizer_state_bytes
from memtrain.models import GPT, GPT_PRESETS
from memtrain.optim import CPUOffloadOptimizer, build_optimizer, optimizer_memory
from memtrain.optim.pure_bf16 import PureBF16AdamW, stochastic_round_to_bf16

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 (or fp64) value (equal where it is exact)."""
    x32 = x.float()
    bits = x32.view(torch.int32) & -65536
    down = bits.view(torch.float32)  # truncation: towards zero
    up = torch.where(down == x32, down, (bits + 65536).view(torch.float32))  # one bf16 ulp away from zero
    return torch.minimum(down, up), torch.maximum(down, up)


@pytest.mark.parametrize("value", [1.0 + 2**-10, -3.0 - 5 * 2**-9, 1e-30 * 1.3, 0.1])
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(value: float) -> None:
    n = 200_000
    x = torch.full((n,), value)
    rounded = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    lo, hi = _neighbours(x[:1])
    assert set(rounded.unique().tolist()) <= {lo.item(), hi.item()}, "rounding to something else than a neighbour"
    p = (x[0].item() - lo.item()) / (hi.item() - lo.item())
    bound = 5 * (hi.item() - lo.item()) * math.sqrt(p * (1 - p) / n)  # five standard deviations of the mean
    assert abs(rounded.double().mean().item() - x[0].item()) <= bound, (
        f"mean {rounded.double().mean().item()!r} vs {x[0].item()!r}: more than {bound:.3g} apart")


def test_exact_values_and_non_finite_ones_are_kept() -> None:
    x = torch.tensor([1.0, -2.5, 0.0, float("inf"), float("-inf")])
    assert torch.equal(stochastic_round_to_bf16(x).float(), x)
    assert stochastic_round_to_bf16(torch.tensor([float("nan")])).isnan().all()


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_the_optimizer_rounds_updates_below_half_an_ulp_without_bias(moments: str) -> None:
    # 1.0 - 1e-3 lies between bf16's 1 - 2**-8 and 1.0: to nearest every weight stays 1.0 (a loss of 1e-3 a step);
    # stochastically a quarter of them go down, the mean within the statistical bound.
    n, lr = 1 << 16, 1e-3
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    p.grad = torch.ones(n, dtype=torch.bfloat16)  # AdamW's first update: lr * g / |g| = lr
    PureBF16AdamW([p], lr=lr, eps=1e-12, weight_decay=0.0, state_precision=moments).step()
    values = p.detach().float()
    assert set(values.unique().tolist()) <= {1.0, 1 - 2**-8}
    share = (1e-3) / 2**-8
    bound = 5 * 2**-8 * math.sqrt(share * (1 - share) / n)
    assert abs(values.double().mean().item() - (1 - lr)) <= bound, values.double().mean().item()


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_one_step_equals_fp64_adamw_within_one_bf16_ulp(moments: str) -> None:
    torch.manual_seed(0)
    w, g = torch.randn(3, 4099, dtype=torch.bfloat16), torch.randn(3, 4099, dtype=torch.bfloat16)
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    PureBF16AdamW([p], **HYPER, state_precision=moments).step()
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    w64, g64 = w.double(), g.double()
    m_hat, v_hat = (1 - b1) * g64 / (1 - b1), (1 - b2) * g64 * g64 / (1 - b2)
    expected = w64 * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    lo, hi = _neighbours(expected.float())
    got = p.detach().float()
    # fp32 arithmetic then one stochastic rounding: one of the two bf16 values around the fp64 result (the fp32
    # result may sit a rounding beyond it: within one ulp either way).
    ulp = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)
    worst = ((got - expected.float()).abs() / ulp).max().item()
    assert worst <= 1.0, f"the step is {worst:.3f} bf16 ulps from fp64 AdamW"
    assert ((got == lo) | (got == hi)).float().mean().item() > 0.999


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPT_PRESETS["gpt-tiny"]).bfloat16()


def _steps(model: GPT, opt: torch.optim.Optimizer, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 256, (2, 32), generator=g)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()


def test_offloaded_equals_the_device_optimizer_and_sends_bf16_over_the_link() -> None:
    device, host = _gpt(), _gpt()
    opt_d = PureBF16AdamW(device.parameters(), **HYPER)
    opt_h = CPUOffloadOptimizer(host.named_parameters(), pure_bf16=True, state_precision="bf16", **HYPER)
    _steps(device, opt_d, 3)
    _steps(host, opt_h, 3)
    for (name, a), b in zip(device.named_parameters(), host.parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max().item()}"
    numel = sum(p.numel() for p in host.parameters())
    assert opt_h.link_bytes == {"device_to_host": 3 * 2 * numel, "host_to_device": 3 * 2 * numel}, opt_h.link_bytes
    assert all(s.master.dtype == torch.bfloat16 and s.grads[0].dtype == torch.bfloat16 for s in opt_h.slots)
    opt_h.close()


CONFIGS = [dict(state_precision=p, offload_fraction=f, step_in_backward=s)
           for p in ("fp32", "bf16") for f in (0.0, 0.5, 1.0) for s in (False, True) if not (f and s)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_resume_is_bit_identical(config: dict) -> None:
    straight = _gpt()
    opt = build_optimizer(straight.named_parameters(), **HYPER, pure_bf16=True, **config)
    _steps(straight, opt, 4)
    opt.close()

    first = _gpt()
    opt = build_optimizer(first.named_parameters(), **HYPER, pure_bf16=True, **config)
    _steps(first, opt, 2)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), opt.state_dict()
    opt.close()
    resumed = _gpt(seed=5)
    resumed.load_state_dict(saved_model)
    opt = build_optimizer(resumed.named_parameters(), **HYPER, pure_bf16=True, **config)
    opt.load_state_dict(saved_opt)
    _steps(resumed, opt, 2, seed=2)
    # The straight run's last two steps drew from seed 1's stream after two batches: replay them the same way.
    replay = _gpt()
    opt_r = build_optimizer(replay.named_parameters(), **HYPER, pure_bf16=True, **config)
    _steps(replay, opt_r, 2)
    _steps(replay, opt_r, 2, seed=2)
    opt.close()
    opt_r.close()
    for (name, a), b in zip(replay.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: resumed differs by {(a - b).abs().max().item()}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_byte_model_equals_what_measure_counts(config: dict) -> None:
    model = _gpt()
    opt = build_optimizer(model.named_parameters(), **HYPER, pure_bf16=True, **config)
    _steps(model, opt, 1)
    predicted = optimizer_memory([(p.numel(), p.dtype) for p in model.parameters()], device_type="cpu",
                                 pure_bf16=True, **config)
    assert predicted.state_bytes == optimizer_state_bytes(opt), (predicted.state_bytes, optimizer_state_bytes(opt))
    host = opt._host
    if host is not None:
        buffers = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for s in host.slots for t in (s.master, *s.grads)}
        assert all(s.cast is None and s.stage is None for s in host.slots)
        assert predicted.host_bytes == predicted.host_state_bytes + sum(buffers.values())
    params = list(model.parameters())
    on_device = params[:len(params) - predicted.offloaded_params]  # the offloaded ones are the last
    assert predicted.device_gradient_bytes == sum(2 * p.numel() for p in on_device)
    opt.close()


def test_what_pure_bf16_cannot_take_is_refused() -> None:
    model = _gpt()
    with pytest.raises(ConfigError, match="rounds a bf16 weight's update to nearest"):
        build_optimizer(model.named_parameters(), **HYPER, pure_bf16=True, state_precision="int8")
    with pytest.raises(ConfigError, match=r"model.to\(torch.bfloat16\)"):
        build_optimizer(GPT(GPT_PRESETS["gpt-tiny"]).named_parameters(), **HYPER, pure_bf16=True)
    with pytest.raises(ConfigError, match="bf16-mixed"):
        build_optimizer(model.named_parameters(), **HYPER, pure_bf16=True,
                        grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ConfigError, match="not bf16"):
        CPUOffloadOptimizer(GPT(GPT_PRESETS["gpt-tiny"]).named_parameters(), pure_bf16=True, **HYPER)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    with pytest.raises(MemtrainError, match="bf16 parameters"):
        PureBF16AdamW([p]).step()


def test_the_host_ram_check_counts_pure_bf16s_own_bytes(monkeypatch) -> None:
    """No fp32 master, bf16 gradient buffers and bf16 moments: 8 bytes a parameter of host RAM (plus alignment),
    not the 16 of an fp32 master's buffers with fp32 moments; the check refuses only below that."""
    import memtrain.optim.host_buffers as host_buffers

    model = _gpt()
    numel = sum(-(-p.numel() // 64) * 64 for p in model.parameters())
    monkeypatch.setattr(host_buffers, "available_host_bytes", lambda: 8 * numel)
    CPUOffloadOptimizer(model.named_parameters(), pure_bf16=True, state_precision="bf16", **HYPER).close()
    monkeypatch.setattr(host_buffers, "available_host_bytes", lambda: 8 * numel - 1)
    with pytest.raises(MemtrainError, match="host RAM"):
        CPUOffloadOptimizer(_gpt().named_parameters(), pure_bf16=True, state_precision="bf16", **HYPER)
