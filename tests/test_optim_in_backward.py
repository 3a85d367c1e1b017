"""memtrain.optim.in_backward: step in backward equals the ordinary step (lagged clipping, fp16 overflow), frees
each gradient as it steps, and is refused where it cannot step per parameter; from the CLI and the planner too."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_training import HYPER, batches, make_model, max_diff, train, train_lagged_clipping
from torch import nn

from memtrain.accumulation import GradientAccumulator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.models import GPT
from memtrain.optim import (
    build_optimizer,
)


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


def _same_state(a, b) -> bool:
    """Two state dicts hold the same keys and values (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("offload_fraction", [0.0, 0.5], ids=["device", "half-offloaded"])
def test_step_after_a_backward_that_stepped_changes_nothing(offload_fraction) -> None:
    """torchtune's optimizer-in-backward contract: the backward steps (the host part and the lagged clipping norm
    included, once its last gradient has landed), so optimizer.step() after it leaves state_dict() and the
    parameters as they were; in a plain loop and through GradientAccumulator's windows."""
    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, step_in_backward=True, offload_fraction=offload_fraction)
    norms = []
    for x, y in batches(3):
        opt.prepare_backward(max_norm=0.5)
        ((model(x) - y) ** 2).sum().backward()
        state, params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
        norms.append(state["lagged_grad_norm"])
        opt.step()
        assert _same_state(opt.state_dict(), state), "step() changed the state dict after the backward stepped"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)), "step() moved weights"
        opt.zero_grad()
    assert len(set(norms)) == 3 and norms[0] > 0, f"each backward records its window's norm: {norms}"

    acc = GradientAccumulator(model, opt, steps=2, max_grad_norm=0.5)
    for i, (x, y) in enumerate(batches(4, seed=2)):
        with acc.micro_batch(is_last=i % 2 == 1):
            acc.backward(((model(x) - y) ** 2).sum(), reduction="sum", items=x.shape[0])
        if i % 2 == 1:
            state = copy.deepcopy(opt.state_dict())
            acc.step()
            assert _same_state(opt.state_dict(), state), "the window's step() changed the state dict"


def test_a_second_backward_before_step_is_refused_naming_the_fix() -> None:
    """Each backward that steps ends a window: a second one before step() (or reentrant checkpointing, one
    backward per block) would step parameters of a window already closed."""
    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, step_in_backward=True)
    x, y = batches(1)[0]
    ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(MemtrainError, match=r"landed after its window had ended.*call optimizer.step\(\) after each"):
        ((model(x) - y) ** 2).sum().backward()
    opt.zero_grad()  # the window dropped (as after an out-of-memory error): the next backward starts a new one
    ((model(x) - y) ** 2).sum().backward()
    opt.step()


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
    with pytest.raises(ConfigError, match="world_size=4: DDP and FSDP2 reduce gradients over the ranks after"):
        build_optimizer(make_model().named_parameters(), lr=1e-3, step_in_backward=True)


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
    from memtrain.choices import Choices, OptimizerChoice
    from memtrain.planner import plan

    torch.manual_seed(0)
    p = plan(GPT.from_preset("gpt-tiny"), budget=None, seq_len=32, global_batch_size=8, device="cpu",
             precision="fp32", micro_batch_size=4,
             choices=Choices(optimizer=OptimizerChoice(placement="device", step_in_backward=True)))
    assert (p.settings.step_in_backward, p.settings.accumulation) == (True, 2), p.summary()
    # The contradiction is Choices' to name now, at construction, before any plan.
    with pytest.raises(ConfigError, match="a partial offload steps after backward") as info:
        plan(GPT.from_preset("gpt-tiny"), budget=None, seq_len=32, global_batch_size=8, device="cpu",
             precision="fp32", choices=Choices(optimizer=OptimizerChoice(placement="device", step_in_backward=True,
                                                                         offload_fraction=0.5)))
    assert "world_size" not in str(info.value) and "cannot accumulate" not in str(info.value), str(info.value)


def test_the_host_parts_window_norm_is_one_pass_on_the_loops_thread() -> None:
    """Step in backward with half the parameters offloaded: the window's norm takes the host gradients' norms in
    one foreach pass (the old code ran a norm and a copy per host parameter on the loop's thread, after
    backward), and the window still clips as torch would (test_step_in_backward_equals_the_ordinary_step)."""
    from helpers import Touches

    model = make_model()
    opt = build_optimizer(model.named_parameters(), **HYPER, step_in_backward=True, offload_fraction=0.5)
    host = opt._host.slots
    assert len(host) >= 3, "the host part must hold several parameters for the count to mean anything"
    storages = {s.grads[0].untyped_storage().data_ptr() for s in host}
    for x, y in batches(2):
        opt.prepare_backward(max_norm=0.5, grad_factor=1 / x.shape[0])
        with Touches(storages) as touches:
            ((model(x) - y) ** 2).sum().backward()  # the window ends in backward's final callback
        norms = [op for op in touches.ops if "norm" in op]
        assert len(norms) == 1, f"{len(norms)} norm ops over {len(host)} host gradients on the loop's thread: {norms}"
        opt.step()
        opt.zero_grad()
