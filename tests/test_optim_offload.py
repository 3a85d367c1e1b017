"""CPUOffloadOptimizer: the same parameters as torch AdamW (clipping, accumulation, fp16, resume), then the bytes.

On this CPU-only machine the "device" is the CPU: the hooks, host buffers, buckets, worker thread and copies back
are the same code as on a GPU, without streams.
"""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from memtrain.accumulation import GradientAccumulator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.models import GPT
from memtrain.optim import CPUOffloadOptimizer

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.hidden = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)
        self.unused = nn.Parameter(torch.ones(3))  # never gets a gradient: both optimizers must skip it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.hidden(torch.relu(self.inp(x))))))


def make_mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def groups(model: nn.Module) -> list[dict]:
    """Two groups: no weight decay on biases and norms, as LLM recipes do."""
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def plain_groups(model: nn.Module) -> list[dict]:
    return [{"params": [p for _, p in g["params"]], **{k: v for k, v in g.items() if k != "params"}}
            for g in groups(model)]


def batches(n: int, seed: int = 1, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g) * 3, torch.randn(batch, 4, generator=g)) for _ in range(n)]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    # Several buckets even for a tiny model, so bucket boundaries are exercised.
    monkeypatch.setattr(CPUOffloadOptimizer, "bucket_numel", 600)


# -- parity -------------------------------------------------------------------------------------------------
def train_pair(steps: int, micro: int, max_norm: float | None, fused: bool, **offload_kwargs) -> tuple:
    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(plain_groups(ref), fused=fused, **HYPER)
    opt = CPUOffloadOptimizer(groups(ours), fused=fused, **HYPER, **offload_kwargs)
    data = batches(steps * micro)
    clipped = 0
    for step in range(steps):
        for m in range(micro):
            x, y = data[step * micro + m]
            (loss_fn(ref, x, y) / micro).backward()
            if m == micro - 1 and max_norm is not None:
                opt.next_backward_is_last()  # its landings take the norms the clip below uses
            (loss_fn(ours, x, y) / micro).backward()
        if max_norm is not None:
            if opt.offload_gradients:  # the worker took every norm during backward: the clip's fast path is tested
                opt.gather_gradients()
                assert all(s.norm is not None for s in opt.slots if s.has_grad)
            # In param_groups order, as ours sums: a different order can move the norm by an ulp.
            ref_norm = torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]],
                                                      max_norm)
            norm = opt.clip_grad_norm_(max_norm)
            assert norm.item() == ref_norm.item(), f"step {step}: norm {norm.item()} vs torch {ref_norm.item()}"
            clipped += ref_norm.item() > max_norm
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    return ref, ours, clipped


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
@pytest.mark.parametrize("offload_gradients", [True, False])
def test_parity_with_adamw_after_100_steps(fused: bool, offload_gradients: bool) -> None:
    ref, ours, clipped = train_pair(100, micro=3, max_norm=0.5, fused=fused, offload_gradients=offload_gradients)
    assert clipped > 50, f"clipping must be active to be tested: it clipped {clipped} of 100 steps"
    diff = max_diff(ref, ours)
    assert diff <= 1e-6, f"max abs difference after 100 steps: {diff:.3e} (tolerance 1e-6)"
    assert torch.equal(ours.unused, torch.ones(3)), "a parameter with no gradient must not move"


def test_parity_fails_without_clipping_on_our_side() -> None:
    """The parity test can fail: the same run without our clip differs from clipped torch AdamW."""
    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = CPUOffloadOptimizer(ours.parameters(), **HYPER)
    for x, y in batches(10):
        loss_fn(ref, x, y).backward()
        loss_fn(ours, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        # The device gradients are gone (offloaded): torch's clip sees none and silently clips nothing.
        assert torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05).item() == 0.0
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert max_diff(ref, ours) > 1e-4


def test_gpt_tiny_parity_with_tied_weights() -> None:
    torch.manual_seed(0)
    ref = GPT.from_preset("gpt-tiny")
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = CPUOffloadOptimizer(ours.named_parameters(), **HYPER)
    g = torch.Generator().manual_seed(3)
    for _ in range(8):
        x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
        ref(x, y).backward()
        ours(x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.clip_grad_norm_(1.0)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert max_diff(ref, ours) == 0.0, f"max abs difference {max_diff(ref, ours):.3e}"


def test_zero_grad_keeping_zeros_matches_torch() -> None:
    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = CPUOffloadOptimizer(ours.parameters(), **HYPER)
    for i, (x, y) in enumerate(batches(6)):
        for model, o in ((ref, ref_opt), (ours, opt)):
            if i % 2 == 0:  # every other step only the head gets a gradient; the rest step on zeros (momentum)
                loss_fn(model, x, y).backward()
            else:
                nn.functional.mse_loss(model.out(x[:, :32].repeat(1, 2)[:, :32]), y).backward()
            o.step()
            o.zero_grad(set_to_none=False)
    assert max_diff(ref, ours) == 0.0, f"max abs difference {max_diff(ref, ours):.3e}"


def test_gradients_leave_the_device_during_backward() -> None:
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.parameters(), **HYPER)
    x, y = batches(1)[0]
    loss_fn(model, x, y).backward()
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    assert left == [], f"device gradients still held after backward: {left}"
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())

    kept = make_mlp()
    CPUOffloadOptimizer(kept.parameters(), offload_gradients=False, **HYPER)
    loss_fn(kept, x, y).backward()
    assert sum(p.grad is not None for p in kept.parameters()) == 8  # every used parameter keeps its gradient


def test_bf16_device_weights_with_fp32_master() -> None:
    ours = make_mlp().to(torch.bfloat16)
    twin = copy.deepcopy(ours)  # computes the same bf16 gradients, for the reference
    ref = copy.deepcopy(ours).float()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = CPUOffloadOptimizer(ours.named_parameters(), **HYPER)
    for x, y in batches(5):
        loss_fn(ours, x.bfloat16(), y.bfloat16()).backward()
        twin.load_state_dict(ours.state_dict())
        loss_fn(twin, x.bfloat16(), y.bfloat16()).backward()
        for p, q in zip(ref.parameters(), twin.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.float()  # the reference steps fp32 on the same gradients
            q.grad = None
        ref_opt.step()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(q, p.to(torch.bfloat16)), f"{name}: device weights are not the fp32 master rounded"
        if name != "unused":
            diff = (sd["state"][name]["master_weight"] - p).abs().max().item()
            assert diff == 0.0, f"{name}: fp32 master differs from fp32 AdamW by {diff:.3e}"


def test_device_dtype_keeps_the_fp32_digits_in_the_master() -> None:
    """device_dtype=bf16 on an fp32 model: the master holds the weights as given (not bf16-rounded), the device
    parameters become the rounded copy, and a step leaves them the rounded master."""
    model = make_mlp()
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = CPUOffloadOptimizer(model.named_parameters(), device_dtype=torch.bfloat16, **HYPER)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, given[name].to(torch.bfloat16)), name
    for slot in opt.slots:
        assert torch.equal(slot.master, given[slot.key]), f"{slot.key}: the master lost fp32 digits"
    x, y = next(iter(batches(1)))
    loss_fn(model, x.bfloat16(), y.bfloat16()).backward()
    opt.step()
    for slot in opt.slots:
        assert torch.equal(slot.device, slot.master.to(torch.bfloat16)), f"{slot.key}: not the rounded master"


# -- fp16 GradScaler ----------------------------------------------------------------------------------------
def test_fp16_scaler_skips_overflow_and_matches_torch() -> None:
    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = CPUOffloadOptimizer(ours.parameters(), grad_scaler=scaler, **HYPER)
    overflow_step = 3
    for model in (ref, ours):  # the same injected overflow in both runs
        model.hidden.weight.register_hook(lambda g, s=[0]: (s.__setitem__(0, s[0] + 1),
                                                            g * float("inf") if s[0] == overflow_step + 1 else g)[1])
    for step, (x, y) in enumerate(batches(6)):
        ref_scaler.scale(loss_fn(ref, x, y)).backward()
        scaler.scale(loss_fn(ours, x, y)).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        norm = opt.clip_grad_norm_(1.0)
        before = [p.detach().clone() for p in ours.parameters()]
        state_before = copy.deepcopy(opt.state_dict()["state"])
        ref_scaler.step(ref_opt)
        scaler.step(opt)
        ref_scaler.update()
        scaler.update()
        if step == overflow_step:
            assert not torch.isfinite(norm)
            assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters(), strict=True)), "skipped step moved"
            after = opt.state_dict()["state"]
            assert all(torch.equal(v, after[k][n]) for k, s in state_before.items() for n, v in s.items())
            assert scaler.get_scale() == 2.0**9, f"scale not backed off: {scaler.get_scale()}"
        assert scaler.get_scale() == ref_scaler.get_scale()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert max_diff(ref, ours) == 0.0, f"max abs difference {max_diff(ref, ours):.3e}"


def test_scaler_without_grad_scaler_argument_is_an_error() -> None:
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.parameters(), **HYPER)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(1)[0]
    scaler.scale(loss_fn(model, x, y)).backward()
    with pytest.raises(MemtrainError, match="grad_scaler=scaler"):
        scaler.step(opt)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
def test_gradient_accumulator_with_gradients_kept_on_the_device(fp16: bool) -> None:
    """GradientAccumulator edits p.grad on the device: with offload_gradients=False it works unchanged."""
    from memtrain.accumulation import GradientAccumulator

    ref, ours = make_mlp(), make_mlp()
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=fp16) for _ in range(2)]
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = CPUOffloadOptimizer(ours.parameters(), offload_gradients=False, grad_scaler=scalers[1], **HYPER)
    accs = [GradientAccumulator(m, o, steps=3, scaler=sc, max_grad_norm=0.5)
            for m, o, sc in ((ref, ref_opt, scalers[0]), (ours, opt, scalers[1]))]
    data = batches(12, batch=4)
    for window in range(4):
        results = []
        for model, acc in zip((ref, ours), accs, strict=True):
            for i in range(3):
                x, y = data[3 * window + i]
                with acc.micro_batch(is_last=i == 2):
                    acc.backward(nn.functional.mse_loss(model(x), y, reduction="sum"), reduction="sum", items=x.numel())
            results.append(acc.step())
        assert results[0].grad_norm == results[1].grad_norm, results
    assert max_diff(ref, ours) == 0.0, f"max abs difference {max_diff(ref, ours):.3e}"


def test_scaler_unscale_with_offloaded_gradients_is_an_error() -> None:
    model = make_mlp()
    scaler = torch.amp.GradScaler("cpu")
    opt = CPUOffloadOptimizer(model.parameters(), grad_scaler=scaler, **HYPER)
    x, y = batches(1)[0]
    scaler.scale(loss_fn(model, x, y)).backward()
    scaler.unscale_(opt)  # finds no gradient on the device: ours would stay scaled
    with pytest.raises(MemtrainError, match="remove scaler.unscale_"):
        scaler.step(opt)


# -- state_dict ---------------------------------------------------------------------------------------------
def run(model: nn.Module, opt: torch.optim.Optimizer, data: list, clip: bool = True) -> None:
    for x, y in data:
        loss_fn(model, x, y).backward()
        if isinstance(opt, CPUOffloadOptimizer):
            opt.clip_grad_norm_(0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def test_state_dict_into_plain_adamw_and_back() -> None:
    data = batches(10)
    ours = make_mlp()
    opt = CPUOffloadOptimizer(ours.named_parameters(), **HYPER)
    run(ours, opt, data[:5])
    sd = opt.state_dict()
    assert set(sd["state"]) == {n for n, _ in ours.named_parameters()} - {"unused"}, sorted(sd["state"])

    plain_model = copy.deepcopy(ours)
    plain = torch.optim.AdamW(plain_model.parameters(), fused=True, **HYPER)
    plain.load_state_dict(sd)
    run(plain_model, plain, data[5:])
    run(ours, opt, data[5:])
    assert max_diff(plain_model, ours) == 0.0, f"ours -> AdamW: {max_diff(plain_model, ours):.3e}"

    # And back: AdamW's state (keyed by index, named here) into a fresh offload optimizer.
    back_model = copy.deepcopy(plain_model)
    back = CPUOffloadOptimizer(back_model.named_parameters(), **HYPER)
    back.load_state_dict(plain.state_dict())
    run(back_model, back, data[:5])
    run(plain_model, plain, data[:5])
    assert max_diff(plain_model, back_model) == 0.0, f"AdamW -> ours: {max_diff(plain_model, back_model):.3e}"


def test_load_matches_by_name_not_position() -> None:
    data = batches(6)
    ref = make_mlp()
    ref_opt = torch.optim.AdamW(ref.named_parameters(), fused=True, **HYPER)  # torch records param_names
    run(ref, ref_opt, data[:3])
    ours = copy.deepcopy(ref)
    opt = CPUOffloadOptimizer(list(reversed(list(ours.named_parameters()))), **HYPER)
    opt.load_state_dict(ref_opt.state_dict())
    loaded = opt.state_dict()["state"]
    for name, p in ref.named_parameters():
        if name != "unused":
            assert torch.equal(loaded[name]["exp_avg"], ref_opt.state[p]["exp_avg"]), f"{name}: wrong entry"
    run(ref, ref_opt, data[3:])
    run(ours, opt, data[3:])
    # Not bit-exact only because the clip sums the norms in the other (reversed) order: an ulp of the norm.
    assert max_diff(ref, ours) <= 1e-6, f"max abs difference {max_diff(ref, ours):.3e}"


def test_resumed_run_continues_bit_identically() -> None:
    data = batches(12)
    straight = make_mlp()
    opt = CPUOffloadOptimizer(straight.named_parameters(), **HYPER)
    run(straight, opt, data)

    first = make_mlp()
    opt1 = CPUOffloadOptimizer(first.named_parameters(), **HYPER)
    run(first, opt1, data[:6])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_mlp(seed=123)  # different initial weights: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2 = CPUOffloadOptimizer(resumed.named_parameters(), **HYPER)
    opt2.load_state_dict(saved["optim"])
    run(resumed, opt2, data[6:])
    assert max_diff(straight, resumed) == 0.0, f"max abs difference {max_diff(straight, resumed):.3e}"


# -- LR schedulers, delayed update --------------------------------------------------------------------------
def test_lr_scheduler_change_takes_effect() -> None:
    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = CPUOffloadOptimizer(ours.parameters(), **HYPER)
    schedule = lambda step: [1.0, 0.5, 0.25, 0.0, 0.0][min(step, 4)]  # noqa: E731
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    frozen = None
    for step, (x, y) in enumerate(batches(6)):
        for model, o, s in ((ref, ref_opt, ref_sched), (ours, opt, sched)):
            loss_fn(model, x, y).backward()
            o.step()
            o.zero_grad()
            s.step()
        assert max_diff(ref, ours) == 0.0, f"step {step}: {max_diff(ref, ours):.3e}"
        if step == 3:
            frozen = [p.detach().clone() for p in ours.parameters()]
    assert opt.param_groups[0]["lr"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(frozen, ours.parameters(), strict=True)), "lr=0 still moved weights"


def test_delayed_update_applies_each_gradient_one_step_late() -> None:
    data = batches(8)
    # Reference: the host master steps on each gradient; the model sees the master of the step before.
    model_ref, master = make_mlp(), make_mlp()
    master_opt = torch.optim.AdamW(master.parameters(), fused=True, **HYPER)
    for x, y in data:
        loss_fn(model_ref, x, y).backward()
        for p, m in zip(model_ref.parameters(), master.parameters(), strict=True):
            m.grad, p.grad = p.grad, None
        model_ref.load_state_dict(master.state_dict())  # update t-1 reaches the device at step t
        master_opt.step()
    model_ref.load_state_dict(master.state_dict())  # synchronize()

    ours = make_mlp()
    opt = CPUOffloadOptimizer(ours.parameters(), delayed_update=True, **HYPER)
    for x, y in data:
        loss_fn(ours, x, y).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert max_diff(model_ref, ours) == 0.0, f"delayed update: {max_diff(model_ref, ours):.3e}"

    eager = make_mlp()
    eager_opt = CPUOffloadOptimizer(eager.parameters(), **HYPER)
    run(eager, eager_opt, data)
    assert max_diff(eager, ours) > 1e-4, "the delayed run must differ from the eager one"


def test_step_in_backward_matches_adamw_and_runs_during_backward() -> None:
    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = CPUOffloadOptimizer(ours.parameters(), **HYPER)
    data = batches(40)
    for step in range(20):
        for micro in range(2):
            x, y = data[2 * step + micro]
            (loss_fn(ref, x, y) / 2).backward()
            if micro == 1:
                opt.step_in_next_backward()  # the last micro-batch of the window
                before = [p.detach().clone() for p in ours.parameters()]
            (loss_fn(ours, x, y) / 2).backward()
        early = list(opt._landing.early.values())
        for future in early:
            future.result()
        moved = sum(not torch.equal(a, b) for a, b in zip(before, ours.parameters(), strict=True))
        assert early and moved > 0, f"no bucket stepped during backward ({len(early)} started, {moved} moved)"
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert max_diff(ref, ours) == 0.0, f"max abs difference {max_diff(ref, ours):.3e}"


def test_step_in_backward_refuses_clipping_and_scaler() -> None:
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.parameters(), **HYPER)
    opt.step_in_next_backward()
    loss_fn(model, *batches(1)[0]).backward()
    with pytest.raises(MemtrainError, match="already stepped with unclipped"):
        opt.clip_grad_norm_(1.0)
    scaled = CPUOffloadOptimizer(make_mlp().parameters(), grad_scaler=torch.amp.GradScaler("cpu"), **HYPER)
    with pytest.raises(MemtrainError, match="fp16 grad_scaler"):
        scaled.step_in_next_backward()


# -- bad input ----------------------------------------------------------------------------------------------
def test_no_parameters() -> None:
    with pytest.raises(ConfigError, match="no parameters"):
        CPUOffloadOptimizer([], lr=1e-3)


def test_parameters_on_several_devices() -> None:
    with pytest.raises(ConfigError, match="several devices"):
        CPUOffloadOptimizer([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))], lr=1e-3)


def test_sparse_gradient() -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = CPUOffloadOptimizer(embedding.parameters(), lr=1e-3)  # kept alive: its hooks see the gradient
    with pytest.raises(MemtrainError, match="sparse gradient"):
        embedding(torch.tensor([1, 2])).sum().backward()
    optimizer.close()


@pytest.mark.parametrize("bad", [torch.optim.AdamW([nn.Parameter(torch.ones(1))]), object, "AdamW"])
def test_optimizer_class_not_a_torch_optimizer(bad: object) -> None:
    with pytest.raises(ConfigError, match="not a torch.optim.Optimizer subclass"):
        CPUOffloadOptimizer(make_mlp().parameters(), bad)


def test_parameters_that_do_not_require_grad() -> None:
    model = make_mlp()
    model.inp.requires_grad_(False)
    with pytest.raises(ConfigError, match="do not require grad") as e:
        CPUOffloadOptimizer(model.named_parameters(), lr=1e-3)
    assert "inp.weight" in str(e.value)


def test_unknown_hyperparameter() -> None:
    with pytest.raises(ConfigError, match="rejected its arguments"):
        CPUOffloadOptimizer(make_mlp().parameters(), lr=1e-3, momentum=0.9)


def test_host_ram_is_checked_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("memtrain.optim.host_buffers.available_host_bytes", lambda: 1000)
    with pytest.raises(MemtrainError, match="of host RAM") as e:
        CPUOffloadOptimizer(make_mlp().parameters(), lr=1e-3)
    assert "available" in str(e.value)


def test_state_dict_of_another_model_is_refused() -> None:
    other = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(4, 32))
    other_opt = torch.optim.AdamW(list(other.parameters()) + [nn.Parameter(torch.ones(3))], **HYPER)
    for p in other_opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    other_opt.step()
    opt = CPUOffloadOptimizer(make_mlp().parameters(), **HYPER)
    with pytest.raises(ConfigError, match="has shapes"):
        opt.load_state_dict(other_opt.state_dict())


def test_add_param_group_is_refused() -> None:
    opt = CPUOffloadOptimizer(make_mlp().parameters(), lr=1e-3)
    with pytest.raises(MemtrainError, match="sized once"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


def test_a_dropped_optimizer_stops_taking_gradients_and_a_live_one_is_not_shared():
    import gc

    model = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    first = CPUOffloadOptimizer(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="already belong to another live CPUOffloadOptimizer"):
        CPUOffloadOptimizer(model.parameters(), lr=0.1)
    del first
    gc.collect()
    second = CPUOffloadOptimizer(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    model(x).sum().backward()
    second.step()
    assert not torch.equal(before, model.weight), "the new optimizer must receive the gradients"
    second.close()
    model(x).sum().backward()
    assert model.weight.grad is not None, "after close() gradients stay on the parameters"


def test_duplicate_parameters_and_offloaded_gradients_under_ddp_are_refused(monkeypatch):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="more than once"):
        CPUOffloadOptimizer([model.weight, model.weight, model.bias])
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ConfigError, match="offload_gradients=False"):
        CPUOffloadOptimizer(model.parameters())
    CPUOffloadOptimizer(model.parameters(), offload_gradients=False).close()


def test_scaled_gradients_keep_the_norms_taken_as_they_landed(monkeypatch):
    """scale_gradients_ (how GradientAccumulator normalises a window) scales the landed norms instead of dropping
    them: clip_grad_norm_ then reads no gradient again, and its norm is the scaled gradients' (rtol 1e-6)."""
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    opt.clip_grad_norm_(1e9)  # the first clip asks the worker to take each norm as its gradient lands
    opt.step()
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    opt.scale_gradients_(0.25)
    want = torch.nn.utils.get_total_norm([g.clone() for g in opt.gradients()], 2.0)

    def reads_gradients_again(*args, **kwargs):
        raise AssertionError("clip_grad_norm_ recomputed the norms")

    opt.zero_grad(set_to_none=True)  # gradients() above dropped the landed norms: land the window again
    model(x).pow(2).sum().backward()
    opt.scale_gradients_(0.25)
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", reads_gradients_again)
    torch.testing.assert_close(opt.clip_grad_norm_(1e9), want, rtol=1e-6, atol=0)
    opt.close()


def test_scaling_after_step_in_next_backward_is_refused():
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
    opt.step_in_next_backward()
    model(torch.randn(4, 16)).sum().backward()
    with pytest.raises(MemtrainError, match="drop step_in_next_backward"):
        opt.scale_gradients_(0.5)
    opt.step()
    opt.close()


# -- work per landing (issue 13 items 5 and 6) --------------------------------------------------------------
class _CountingWorker:
    """Stands in for the optimizer's worker pool, counting the tasks submitted by the function's name."""

    def __init__(self, pool) -> None:
        self.pool, self.names = pool, []

    def submit(self, fn, *args, **kwargs):
        self.names.append(getattr(fn, "__name__", repr(fn)))
        return self.pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        self.pool.shutdown(wait=wait)


def test_norms_are_taken_in_the_windows_last_backward_only(monkeypatch) -> None:
    """A 3-micro-batch window through GradientAccumulator takes each gradient's norm once, in the last backward
    (the old code took one per landing after the first clip: 3 per parameter), and the clip uses them."""
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
    acc = GradientAccumulator(model, opt, steps=3, max_grad_norm=0.5)
    worker_norms = []
    real_norm = torch.linalg.vector_norm

    def counting_norm(*args, **kwargs):
        if threading.current_thread().name.startswith("memtrain-cpu-optim"):
            worker_norms.append(1)
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", counting_norm)
    data = batches(9)
    with_grad = sum(p is not model.unused for p in model.parameters())
    for window in range(3):
        worker_norms.clear()
        for m in range(3):
            with acc.micro_batch(is_last=m == 2):
                acc.backward(loss_fn(model, *data[3 * window + m]), reduction="mean")
        opt.gather_gradients()
        assert all(s.norm is not None for s in opt.slots if s.has_grad), "the clip would read every gradient"
        acc.step()
        assert len(worker_norms) == with_grad, (
            f"window {window}: {len(worker_norms)} norms taken on the worker for {with_grad} gradients")


def test_gradients_land_with_one_worker_task_per_bucket() -> None:
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.named_parameters(), **HYPER)
    opt._landing.worker = _CountingWorker(opt._landing.worker)
    n_buckets = len(opt._buckets)
    assert n_buckets == 3 and len(opt.slots) == 9, "the fixture's bucket size must give several buckets"
    data = batches(3)
    for m, (x, y) in enumerate(data):
        before = len(opt._landing.worker.names)
        if m == 2:
            opt.next_backward_is_last()
        loss_fn(model, x, y).backward()
        opt._landing.flush()  # hands over a bucket whose parameter got no gradient (step() does it too)
        tasks = [n for n in opt._landing.worker.names[before:] if "landing" in n]
        assert len(tasks) <= n_buckets, f"micro-batch {m}: {len(tasks)} landing tasks for {n_buckets} buckets"
    opt.step()
    opt.close()


def test_delayed_update_casts_on_the_worker_and_lands_the_rounded_master(monkeypatch) -> None:
    """With bf16 device weights, the fp32 -> bf16 cast of the new weights runs on the worker as each bucket
    finishes, not in the loop's thread at the next step(); the device still gets the master rounded."""
    model = make_mlp().to(torch.bfloat16)
    opt = CPUOffloadOptimizer(model.named_parameters(), delayed_update=True, **HYPER)
    main_casts = []
    real_copy = torch.Tensor.copy_

    def spying_copy(dst, src, *args, **kwargs):
        if (threading.current_thread() is threading.main_thread() and dst.dtype == torch.bfloat16
                and src.dtype == torch.float32):
            main_casts.append(tuple(dst.shape))
        return real_copy(dst, src, *args, **kwargs)

    for x, y in batches(4):
        loss_fn(model, x.bfloat16(), y.bfloat16()).backward()
        monkeypatch.setattr(torch.Tensor, "copy_", spying_copy)
        opt.step()
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        opt.zero_grad()
    assert main_casts == [], f"step() cast {len(main_casts)} tensors fp32 -> bf16 on the loop's thread"
    opt.synchronize()
    for slot in opt.slots:
        assert torch.equal(slot.device, slot.master.to(torch.bfloat16)), f"{slot.key}: not the rounded master"


# -- passes over the host gradients -------------------------------------------------------------------------
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
def test_normalising_unscaling_and_clipping_make_no_pass_over_host_gradients(fp16: bool) -> None:
    """Between backward and the host step, scale_gradients_ (the window's 1/items), the fp16 unscale and
    clip_grad_norm_ touch no host gradient (aten ops reading or writing their buffers, counted with a
    TorchDispatchMode on this thread): the factor, 1/scale and the clip coefficient are applied inside the step,
    the norm comes from the norms taken as the gradients landed. The old code made one pass each (a multiply
    for the factor, an unscale, a multiply for the clip). The step stays within 1e-6 of torch AdamW."""
    from helpers import Touches

    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if fp16 else None
    opt = CPUOffloadOptimizer(ours.parameters(), grad_scaler=scaler, **HYPER)
    x, y = batches(1)[0]
    loss_fn(ref, x, y).mul(3).backward()
    ref_grads = [p.grad for p in ref.parameters() if p.grad is not None]
    torch._foreach_mul_(ref_grads, 1 / 3)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    opt.next_backward_is_last()
    loss = loss_fn(ours, x, y).mul(3)
    (scaler.scale(loss) if fp16 else loss).backward()
    opt._landing.flush()
    for future in opt._landing.tasks:
        future.result()  # the landings (copies, norms) are backward's work, done on the worker
    storages = {s.grads[0].untyped_storage().data_ptr() for s in opt.slots}
    with Touches(storages) as touches:
        opt.scale_gradients_(1 / 3)
        norm = opt.clip_grad_norm_(0.05)
    assert touches.ops == [], f"{len(touches.ops)} ops on host gradients before the step: {touches.ops}"
    assert norm.item() > 0.05, "clipping must be active to be tested"
    if fp16:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    assert max_diff(ref, ours) <= 1e-6, f"max abs difference {max_diff(ref, ours):.3e} (tolerance 1e-6)"
    opt.close()


def test_bf16_gradients_land_in_owned_pinned_stages_that_the_host_ram_check_counts(monkeypatch) -> None:
    """With bf16 device weights each gradient lands in a stage buffer the optimizer owns (pinned on CUDA, sized
    once, same layout as the cast buffers), not in torch's pinned cache (rounded up to powers of two, kept for the
    process's life, invisible to the check); the host-RAM check counts every buffer: it refuses a machine with one
    byte less than masters + gradients + casts + state. Without a delayed update the stage is the cast buffer (the
    stage is read before the step, the cast written after it); with one, whose step overlaps the next backward,
    each has its own."""
    import memtrain.optim.gradient_landing as gradient_landing
    import memtrain.optim.host_buffers as host_buffers

    model = make_mlp()
    params = list(model.parameters())
    aligned = sum(host_buffers.aligned(p.numel()) for p in params)
    buffers = (4 + 4 + 2) * aligned  # fp32 master and gradient, bf16 cast (and stage)
    need = buffers + 8 * aligned  # and AdamW's two fp32 moments
    monkeypatch.setattr(host_buffers, "available_host_bytes", lambda: need - 1)
    with pytest.raises(MemtrainError, match="host RAM"):
        CPUOffloadOptimizer(params, device_dtype=torch.bfloat16, **HYPER)
    monkeypatch.setattr(host_buffers, "available_host_bytes", lambda: need)
    opt = CPUOffloadOptimizer(params, device_dtype=torch.bfloat16, **HYPER)
    owned = {}
    for slot in opt.slots:
        for t in (slot.master, *slot.grads, slot.cast, slot.stage):
            owned[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(owned.values()) == buffers, (sum(owned.values()), buffers)
    stages = {s.stage.untyped_storage().data_ptr() for s in opt.slots}
    staged_in = []
    finish = gradient_landing.finish_landings

    def spy(landings, event, acc):
        staged_in.extend(landing.staged.untyped_storage().data_ptr() for landing in landings if landing.staged is not None)
        return finish(landings, event, acc)

    monkeypatch.setattr(gradient_landing, "finish_landings", spy)
    for x, y in batches(2):  # two micro-batches: the second landing adds to the first
        loss_fn(model, x.bfloat16(), y.bfloat16()).float().backward()
    opt.step()
    landed = [p for p in params if p is not model.unused]
    assert len(staged_in) == 2 * len(landed) and set(staged_in) <= stages, "a gradient was staged outside the stages"
    opt.close()
    monkeypatch.setattr(host_buffers, "available_host_bytes", lambda: need + 6 * aligned - 1)
    with pytest.raises(MemtrainError, match="host RAM"):  # a second fp32 gradient buffer and a separate stage
        CPUOffloadOptimizer(params, device_dtype=torch.bfloat16, delayed_update=True, **HYPER)
    monkeypatch.setattr(host_buffers, "available_host_bytes", lambda: need + 6 * aligned)
    opt = CPUOffloadOptimizer(params, device_dtype=torch.bfloat16, delayed_update=True, **HYPER)
    assert all(s.stage.untyped_storage().data_ptr() != s.cast.untyped_storage().data_ptr() for s in opt.slots)
    opt.close()


def test_each_direction_of_the_link_has_its_own_side_stream_and_its_bytes_counted(monkeypatch) -> None:
    """delayed_update: the gradient copies of backward go on the device->host side stream, the weights of the
    previous update go back on the host->device one (on CUDA two streams, so the copy-back does not queue behind the
    next backward's gradient copies). The bytes each way per step are what the planner's link model takes:
    micro-batches x gradient bytes down (fp32 here), the weights in their device dtype up."""
    model = make_mlp()
    opt = CPUOffloadOptimizer(model.parameters(), delayed_update=True, **HYPER)
    assert set(opt._streams) == {"device_to_host", "host_to_device"}
    issued: list[tuple[str, str]] = []
    phase = ["backward"]
    from memtrain.optim.host_buffers import Link

    side_stream = Link.side_stream  # the landings' and the stepper's one way onto a side stream

    def record(self, direction):
        issued.append((phase[0], direction))
        return side_stream(self, direction)

    monkeypatch.setattr(Link, "side_stream", record)
    landed = [p for p in model.parameters() if p is not model.unused]
    grad_bytes = sum(4 * p.numel() for p in landed)
    weight_bytes = sum(4 * p.numel() for p in model.parameters())
    data = batches(6)
    for step in range(3):
        before = dict(opt.link_bytes)
        phase[0] = "backward"
        for x, y in data[2 * step:2 * step + 2]:  # two micro-batches
            loss_fn(model, x, y).backward()
        phase[0] = "step"
        opt.step()
        opt.zero_grad()
        down = opt.link_bytes["device_to_host"] - before["device_to_host"]
        up = opt.link_bytes["host_to_device"] - before["host_to_device"]
        assert down == 2 * grad_bytes, (step, down, 2 * grad_bytes)
        assert up == (weight_bytes if step > 0 else 0), (step, up)  # step t's weights go up at step t + 1
    assert {d for p, d in issued if p == "backward"} == {"device_to_host"}, issued
    assert {d for p, d in issued if p == "step"} == {"host_to_device"}, issued
    opt.close()
