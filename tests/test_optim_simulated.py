"""CPUOffloadOptimizer's device paths on the simulated accelerator (issue 28): streams, events, asynchronous copies
and pinned slabs run as on a GPU, with side streams that poison what is read before it is waited.

Each case trains the tiny MLP of tests/test_optim_offload.py for a few steps on ``simulate("64MiB", lag=L)`` and
compares the weights with the same loop on the plain CPU (no streams: the path tests/test_optim_offload*.py tie to
torch's AdamW, bit for bit or within their 1e-6): every case is bit-identical (max abs difference 0.0) at every lag.
Then each missing wait the simulator must catch is put back (patched) and the same check must fail.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_optim_offload import HYPER, batches, loss_fn, make_mlp, small_buckets  # noqa: F401 (autouse: 3 buckets)

import memtrain.optim.gradient_landing as gradient_landing
from memtrain.device import simulate
from memtrain.device.simulated import SimulatedRaceError
from memtrain.optim import CPUOffloadOptimizer, build_optimizer
from memtrain.optim.host_stepper import HostStepper

LAGS = (0, 1, 3, None)
STEPS = 3


@dataclass(frozen=True)
class Case:
    """One way of training through the offloaded optimizer."""

    micro: int = 1  # micro-batches per window
    clip: float | None = None
    delayed_update: bool = False
    in_backward: bool = False  # step_in_next_backward() on the window's last micro-batch
    device_dtype: torch.dtype | None = None
    options: dict[str, Any] = field(default_factory=dict)  # more CPUOffloadOptimizer arguments
    partial: bool = False  # build_optimizer(offload_fraction=0.5): ComposedOptimizer's host part
    pure_bf16: bool = False
    fp16_overflow_at: int | None = None  # an fp16 GradScaler, and an inf gradient at this step (skipped)
    resume_at: int | None = None  # state_dict round trip (model and optimizer) before this step


CASES = {
    **{f"{dt}-{mode}": Case(device_dtype=torch.bfloat16 if dt == "bf16" else None, **kwargs)
       for dt in ("fp32", "bf16")
       for mode, kwargs in {"eager": {}, "delayed": dict(micro=2, delayed_update=True),
                            "in-next-backward": dict(micro=2, in_backward=True),
                            "window2-clip": dict(micro=2, clip=0.5)}.items()},
    "partial": Case(micro=2, clip=0.5, partial=True),
    "lean-moments": Case(micro=2, clip=0.5, options=dict(state_precision="bf16")),
    "pure-bf16": Case(micro=2, clip=0.5, pure_bf16=True),
    "fp16-skip": Case(clip=1.0, fp16_overflow_at=1),
    "resume-bf16": Case(micro=2, clip=0.5, device_dtype=torch.bfloat16, resume_at=2),
}


def _build(case: Case, model: torch.nn.Module, scaler: Any) -> torch.optim.Optimizer:
    if case.partial:
        opt = build_optimizer(model.named_parameters(), **HYPER, offload_fraction=0.5)
        opt.grad_scaler = scaler
        return opt
    return CPUOffloadOptimizer(model.named_parameters(), **HYPER, delayed_update=case.delayed_update,
                               device_dtype=case.device_dtype, pure_bf16=case.pure_bf16, grad_scaler=scaler,
                               **case.options)


def train(case: Case, acc: Any = None) -> list[torch.Tensor]:
    """The case's loop (on the simulated device when ``acc`` is given); returns the final weights in fp32."""
    compute = acc.compute if acc is not None else nullcontext
    model = make_mlp()
    if case.pure_bf16:
        model = model.bfloat16()
    if acc is not None:
        acc.place(model)
    dtype = torch.bfloat16 if case.pure_bf16 or case.device_dtype is not None else torch.float32
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case.fp16_overflow_at is not None else None
    opt = _build(case, model, scaler)
    offloader = opt._host if case.partial else opt
    assert all((s is not None) == (acc is not None) for s in offloader._streams.values()), "streams iff simulated"
    if case.fp16_overflow_at is not None:
        count = [0]

        def overflow(grad: torch.Tensor) -> torch.Tensor:
            count[0] += 1
            return grad * float("inf") if count[0] == case.fp16_overflow_at + 1 else grad

        model.hidden.weight.register_hook(overflow)
    data = batches(STEPS * case.micro)
    for step in range(STEPS):
        if step == case.resume_at:
            model, opt = _resumed(case, model, opt, acc, scaler)
        for m in range(case.micro):
            x, y = data[step * case.micro + m]
            last = m == case.micro - 1
            with compute():
                if last and case.in_backward:
                    opt.step_in_next_backward()
                if last and case.clip is not None and hasattr(opt, "next_backward_is_last"):
                    opt.next_backward_is_last()
                loss = loss_fn(model, x.to(dtype), y.to(dtype)).float() / case.micro
                (scaler.scale(loss) if scaler is not None else loss).backward()
        with compute():
            if case.clip is not None:
                opt.clip_grad_norm_(case.clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    if acc is not None:
        with torch.no_grad():  # NOTE: a copy the simulator still holds may write a parameter (a leaf)
            acc.synchronize()
    weights = [p.detach().float().clone() for p in model.parameters()]
    if hasattr(opt, "close"):
        opt.close()
    return weights


def _resumed(case: Case, model: torch.nn.Module, opt: Any, acc: Any, scaler: Any) -> tuple[Any, Any]:
    """A checkpoint of the model and the optimizer through torch.save, loaded into a fresh pair (other weights)."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    opt.close()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_mlp(seed=123)
    resumed.load_state_dict(saved["model"])
    if acc is not None:
        acc.place(resumed)
    opt = _build(case, resumed, scaler)
    opt.load_state_dict(saved["optim"])
    return resumed, opt


_PLAIN: dict[str, list[torch.Tensor]] = {}


def parity(name: str, lag: int | None) -> tuple[float, bool]:
    """(max abs difference from the plain-CPU run, whether a NaN reached the weights) of case ``name`` on the
    simulated device at ``lag``."""
    if name not in _PLAIN:
        _PLAIN[name] = train(CASES[name])
    with simulate("64MiB", lag=lag) as acc:
        ours = train(CASES[name], acc)
    nan = any(torch.isnan(w).any().item() for w in ours)
    diff = max((a - b).abs().max().item() for a, b in zip(_PLAIN[name], ours, strict=True))
    return diff, nan


@pytest.mark.parametrize("lag", LAGS, ids=lambda lag: f"lag{lag}")
@pytest.mark.parametrize("name", list(CASES))
def test_the_offloaded_optimizer_on_the_simulated_device_is_bit_identical(name: str, lag: int | None) -> None:
    diff, nan = parity(name, lag)
    assert not nan and diff == 0.0, f"{name} at lag {lag}: max abs difference {diff:.3e} from the plain run, NaN {nan}"


def test_the_plain_run_is_torchs_adamw() -> None:
    """The reference itself: the fp32 eager case on the plain CPU is torch's fused AdamW bit for bit."""
    ref = make_mlp()
    opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    for x, y in batches(STEPS):
        loss_fn(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
    ours = train(CASES["fp32-eager"])
    assert all(torch.equal(a, b) for a, b in zip(ours, ref.parameters(), strict=True))


# -- faults: each missing wait, put back, must fail the parity check -----------------------------------------------
def _no_landing_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gradient_landing.finish_landings
    monkeypatch.setattr(gradient_landing, "finish_landings", lambda landings, event, acc: real(landings, None, acc))


def _no_compute_wait_after_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    def after_copies(self: HostStepper) -> None:
        h2d = self.streams["host_to_device"]
        if h2d is not None:
            self.h2d_done = self.acc.record_event(h2d)  # recorded, but the compute stream does not wait

    monkeypatch.setattr(HostStepper, "after_copies", after_copies)


def _no_producer_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gradient_landing.GradientLanding, "_after_producer", lambda self, d2h: None)


def _copies_back_without_waiting_for_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host-to-device stream no longer waits for the compute stream before the copies back: they may
    overwrite weights that queued backward kernels still read (a write-after-read race)."""
    init = HostStepper.__init__

    def init_stepper(self: HostStepper, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        h2d, real = self.streams["host_to_device"], self.acc.wait_stream
        if h2d is not None:
            self.acc.wait_stream = lambda stream, other: None if stream is h2d else real(stream, other)

    monkeypatch.setattr(HostStepper, "__init__", init_stepper)


FAULTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "no-event-sync-before-reading-landed-gradients": _no_landing_sync,
    "no-compute-wait-after-the-copies-back": _no_compute_wait_after_copies,
    "device-to-host-copy-without-waiting-for-the-producer": _no_producer_wait,
    "copies-back-without-waiting-for-the-readers": _copies_back_without_waiting_for_readers,
}


# The lags at which each fault shows in the fp32 eager case (lag 0 runs every copy at once: nothing to catch; at lag
# 1 the one copy back left queued is the MLP's unused parameter's, which no forward reads, and the hook copies a
# gradient more than one compute op after autograd wrote it; the copies back of an eager step follow the last
# read of the weights by more than 3 compute ops, so only an unbounded lag leaves those reads unfinished).
CAUGHT_AT = {"no-event-sync-before-reading-landed-gradients": (1, 3, None),
             "no-compute-wait-after-the-copies-back": (3, None),
             "device-to-host-copy-without-waiting-for-the-producer": (3, None),
             "copies-back-without-waiting-for-the-readers": (None,)}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_missing_wait_fails_the_parity_check(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fault fails the fp32 eager case at the lags of CAUGHT_AT, and bf16 device weights with a clipped
    window of two micro-batches at the unbounded lag (streams run only when waited)."""
    FAULTS[fault](monkeypatch)
    for name, lags in (("fp32-eager", CAUGHT_AT[fault]), ("bf16-window2-clip", (None,))):
        for lag in lags:
            try:
                diff, nan = parity(name, lag)
            except SimulatedRaceError:
                continue  # the simulator saw the race itself
            assert nan or diff > 0, f"{fault} went unseen in {name} at lag {lag}: max abs difference {diff:.3e}"


def test_an_optimizer_built_from_host_weights_takes_the_device_it_will_train_on(monkeypatch) -> None:
    """apply_plan builds the offloaded optimizer before it places the model: the seam (streams, pinned buffers) must
    be the training device's, not the CPU's where the weights still are."""
    import memtrain.optim.offload as offload_module

    asked = []
    with simulate("64MiB") as acc:
        monkeypatch.setattr(offload_module, "accelerator", lambda device: (asked.append(device), acc)[1])
        opt = CPUOffloadOptimizer(make_mlp().parameters(), device="cuda:3", lr=1e-3)
        assert asked == [torch.device("cuda", 3)] and opt.device == torch.device("cuda", 3)
        assert opt._streams["device_to_host"] is not None
        opt.close()
