"""memtrain.optim.composed: ComposedOptimizer's parity with torch AdamW (accumulation, clipping, LR schedules), its
state precisions training alike, and its state_dict (bit-identical resume, conversion between precisions).

The training builders (make_model, batches, train, ...) live in tests/optim_training.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from optim_training import HYPER, batches, make_model, max_diff, train

from memtrain.accumulation import GradientAccumulator
from memtrain.errors import ConfigError
from memtrain.models import GPT
from memtrain.optim import (
    BF16StateAdamW,
    build_optimizer,
    moments_of,
)


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


@pytest.mark.parametrize("options", [{}, {"state_precision": "int8"}, {"offload_fraction": 0.5}],
                         ids=["fp32", "int8", "half-offloaded"])
def test_load_state_dict_keeps_every_param_group_key(options) -> None:
    """As torch's optimizers do (torch's own test_optim load/state-dict tests): a scheduler's ``initial_lr`` and any
    other key of the saved group survive loading, so ``StepLR(opt, ..., last_epoch=k)`` resumes (it raised KeyError
    when only lr, betas, eps and weight_decay were kept)."""
    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, **options)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batches(1)[0]
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    scheduler.step()
    opt.param_groups[0]["note"] = "kept"
    saved = opt.state_dict()
    again = build_optimizer(make_model().named_parameters(), **HYPER, **options)
    again.load_state_dict(saved)
    assert again.param_groups[0]["initial_lr"] == HYPER["lr"] and again.param_groups[0]["note"] == "kept"
    assert again.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == HYPER["lr"] / 2
    torch.optim.lr_scheduler.StepLR(again, step_size=1, gamma=0.5, last_epoch=1)  # KeyError 'initial_lr' before
