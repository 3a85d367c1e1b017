"""Optimizers compose (issue 30): any torch.optim.Optimizer class, named by short name, dotted path or class,
trains through memtrain's wrappers (step in backward, a partial offload, the offloaded optimizer) with the same
weights as the plain class (bit for bit on the CPU and on the simulated device), and its bytes come from probe steps
that equal what the built optimizer holds.

The two additions that prove it: torch's ``Adafactor`` (factored second moments) and pytorch-optimizer's ``Lion``
(one moment: half of AdamW's state).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from test_optim_offload import batches, loss_fn, make_mlp, small_buckets  # noqa: F401 (autouse: 3 buckets)

from memtrain.choices import Choices, OptimizerChoice
from memtrain.device import simulate
from memtrain.errors import ConfigError
from memtrain.estimate import estimate
from memtrain.measure import optimizer_state_bytes
from memtrain.optim import CPUOffloadOptimizer, build_optimizer, optimizer_memory
from memtrain.optim.probe import PROBE_NUMEL, _probe
from memtrain.techniques.optimizer import NamedOptimizer

LR, WD = 1e-2, 0.1
CLASSES = {"adafactor": (torch.optim.Adafactor, {}), "lion": ("pytorch_optimizer.Lion", {"betas": (0.9, 0.98)}),
           "sgd-momentum": ("sgd", {"momentum": 0.9})}
WRAPPERS = {"device": {}, "in-backward": {"step_in_backward": True}, "partial": {"offload_fraction": 0.5},
            "host": {"offload_fraction": 1.0}}


def _plain(named: NamedOptimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    return named.resolve()(model.parameters(), **named.hyperparameters(lr=LR, weight_decay=WD))


def _train(build: Any, steps: int = 3, acc: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    compute = acc.compute if acc is not None else nullcontext
    model = make_mlp()
    if acc is not None:
        acc.place(model)
    opt = build(model)
    for x, y in batches(steps):
        with compute():
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    if acc is not None:
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        with torch.no_grad():
            acc.synchronize()
    return model, opt


def _diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- names --------------------------------------------------------------------------------------------------
def test_a_class_is_named_by_short_name_path_or_class() -> None:
    assert NamedOptimizer.of("adafactor") == NamedOptimizer.of("torch.optim.Adafactor")
    assert NamedOptimizer.of(torch.optim.Adafactor).path == "torch.optim.Adafactor"  # not torch.optim._adafactor
    assert NamedOptimizer.of(None).is_adamw and NamedOptimizer.of("adamw").is_adamw
    assert NamedOptimizer.of(torch.optim.AdamW).is_adamw  # AdamW itself is memtrain's (lean moments, host kernels)
    assert NamedOptimizer.of("AdamW").is_adamw and NamedOptimizer.of(" Adafactor ").path == "torch.optim.Adafactor"
    with pytest.raises(ConfigError, match="kwargs .* with memtrain's AdamW"):
        NamedOptimizer.of(NamedOptimizer(), {"bogus": 1})
    assert NamedOptimizer.of(NamedOptimizer.of("lion"), {"betas": (0.9, 0.9)}).kwargs == (("betas", (0.9, 0.9)),)
    named = NamedOptimizer.of("lion", {"betas": [0.9, 0.98]})
    assert NamedOptimizer.from_dict(named.to_dict()) == named
    assert named.hyperparameters(lr=1.0, weight_decay=0.5) == {"lr": 1.0, "weight_decay": 0.5, "betas": (0.9, 0.98)}


@pytest.mark.parametrize(("value", "words"), [
    ("no_such_module_xyz.Opt", "cannot be imported"),
    ("torch.optim.NoSuchOptimizer", "has no torch.optim.Optimizer class"),
    ("torch.nn.Linear", "has no torch.optim.Optimizer class"),
    ("nodots", "neither"),
    (3, "names no optimizer"),
])
def test_a_bad_name_is_one_clear_error(value: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as e:
        NamedOptimizer.of(value)
    assert "To resolve this error" in str(e.value)


def test_a_missing_package_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import memtrain.techniques.optimizer.named as named_module

    named_module._import.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "pytorch_optimizer", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"memtrain\[optimizers\]"):
        NamedOptimizer.of("lion")
    named_module._import.cache_clear()


def test_lean_moments_and_pure_bf16_are_adamws_alone() -> None:
    with pytest.raises(ConfigError, match="state_precision='bf16'.*another optimizer class keeps its own state"):
        OptimizerChoice(name="lion", state_precision="bf16")
    with pytest.raises(ConfigError, match="pure_bf16=True"):
        Choices(optimizer=OptimizerChoice(name="adafactor"), pure_bf16=True)
    with pytest.raises(ConfigError, match="state_precision='int8'"):
        build_optimizer(make_mlp().named_parameters(), lr=LR, optimizer_class="adafactor", state_precision="int8")


def test_a_class_that_cannot_step_on_the_host_is_one_clear_error() -> None:
    class DeviceOnly(torch.optim.SGD):  # a CUDA-only kernel, as bitsandbytes' paged optimizers
        def step(self, closure: Any = None) -> Any:
            if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
                raise RuntimeError("this kernel runs on CUDA only")
            return super().step(closure)

    with pytest.raises(ConfigError, match="cannot step a torch.float32 CPU tensor.*CUDA only.*To resolve"):
        build_optimizer(make_mlp().named_parameters(), lr=LR, optimizer_class=DeviceOnly, offload_fraction=1.0)


def test_choices_carry_the_optimizer_through_a_config_file() -> None:
    choices = Choices(optimizer=OptimizerChoice(name=torch.optim.Adafactor, kwargs={"beta2_decay": -0.5}))
    saved = choices.to_dict()
    assert saved["optimizer"]["name"] == "torch.optim.Adafactor"
    assert saved["optimizer"]["kwargs"] == {"beta2_decay": -0.5}
    again = Choices.from_dict(saved)
    assert again.optimizer.named == choices.optimizer.named
    assert Choices().to_dict()["optimizer"]["name"] is None  # memtrain's AdamW


# -- parity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("name", list(CLASSES))
def test_each_wrapper_over_a_named_class_trains_as_the_plain_class(name: str, wrapper: str) -> None:
    """Bit for bit (max abs difference 0.0): the wrappers run the class's own step on the same tensors, in fp32."""
    cls, kwargs = CLASSES[name]
    named = NamedOptimizer.of(cls, kwargs)
    ref, _ = _train(lambda m: _plain(named, m))
    ours, opt = _train(lambda m: build_optimizer(m.named_parameters(), lr=LR, weight_decay=WD, optimizer_class=cls,
                                                 optimizer_kwargs=kwargs, **WRAPPERS[wrapper]))
    assert _diff(ref, ours) == 0.0, f"{name} {wrapper}: max abs difference {_diff(ref, ours)}"
    if hasattr(opt, "close"):
        opt.close()


@pytest.mark.parametrize("wrapper", ["partial", "host", "in-backward"])
def test_a_named_class_resumes_bit_identically(wrapper: str) -> None:
    """state_dict after 2 steps into a fresh optimizer, then 2 more steps: as 4 steps without the round trip."""
    def build(m: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(m.named_parameters(), lr=LR, weight_decay=WD, optimizer_class="adafactor",
                               **WRAPPERS[wrapper])

    straight, _ = _train(build, steps=4)
    model, opt = _train(build, steps=2)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["optimizer"] == "torch.optim.Adafactor"
    resumed = copy.deepcopy(model)
    opt2 = build(resumed)
    opt2.load_state_dict(saved)
    for x, y in batches(4)[2:]:
        loss_fn(resumed, x, y).backward()
        opt2.step()
        opt2.zero_grad(set_to_none=True)
    assert _diff(straight, resumed) == 0.0
    with pytest.raises(ConfigError, match="state_dict is 'torch.optim.Adafactor'"):
        build_optimizer(make_mlp().named_parameters(), lr=LR, optimizer_class="lion",
                        **WRAPPERS[wrapper]).load_state_dict(saved)


@pytest.mark.parametrize("lag", [0, 3, None], ids=lambda lag: f"lag{lag}")
@pytest.mark.parametrize("name", ["adafactor", "lion"])
def test_the_offloaded_named_class_on_the_simulated_device_is_bit_identical(name: str, lag: int | None) -> None:
    """CPUOffloadOptimizer(optimizer_class=...) with side streams that run behind and poison unwaited reads."""
    cls, kwargs = CLASSES[name]
    named = NamedOptimizer.of(cls, kwargs)
    hyper = {"optimizer_class": named.resolve(), **named.hyperparameters(lr=LR, weight_decay=WD)}
    ref, _ = _train(lambda m: _plain(named, m))
    with simulate("64MiB", lag=lag) as acc:
        ours, opt = _train(lambda m: CPUOffloadOptimizer(m.named_parameters(), **hyper), acc=acc)
        assert all(s is not None for s in opt._streams.values())
        opt.close()
    assert _diff(ref, ours) == 0.0


# -- bytes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CLASSES))
def test_the_probe_equals_the_built_optimizers_state(name: str) -> None:
    cls, kwargs = CLASSES[name]
    named = NamedOptimizer.of(cls, kwargs)
    model, opt = _train(lambda m: _plain(named, m))
    params = [p for p in model.parameters() if p in opt.state]  # the MLP's unused parameter gets no state
    assert len(params) == len(list(model.parameters())) - 1
    memory = optimizer_memory([(p.numel(), p.dtype) for p in params], named=named,
                              shapes=[tuple(p.shape) for p in params], device_type="cpu")
    assert memory.device_state_bytes == optimizer_state_bytes(opt), (memory, optimizer_state_bytes(opt))


@pytest.mark.parametrize("shape", [(1100, 1024), (4096, 300), (3 * PROBE_NUMEL // 2,), (8, 512, 512), (2, 3, 700, 400)])
def test_a_large_parameters_fitted_state_equals_its_probe(shape: tuple[int, ...]) -> None:
    """Above PROBE_NUMEL elements the state is fitted from four smaller shapes: exact for Adafactor's factored
    state and for element-wise states."""
    for name in ("adafactor", "lion", "came"):
        named = NamedOptimizer.of(*CLASSES.get(name, (name, {})))
        assert named.state_sizes(shape, torch.float32) == _probe(named.resolve(), named.kwargs, shape, torch.float32)


def test_lion_holds_half_of_adamws_state_and_adafactor_a_row_and_a_column() -> None:
    numel = 4096 * 4096
    lion = NamedOptimizer.of("lion").state_bytes((4096, 4096), torch.float32)
    adafactor = NamedOptimizer.of("adafactor").state_bytes((4096, 4096), torch.float32)
    adamw = optimizer_memory([(numel, torch.float32)]).device_state_bytes
    assert lion == 4 * numel and adamw == 8 * numel + 4
    assert adafactor == 4 + 4 * 4096 + 4 * 4096


@pytest.mark.parametrize("placement", ["device", "offload"])
@pytest.mark.parametrize("name", ["adafactor", "lion"])
def test_estimate_of_a_named_class_equals_the_measured_step(name: str, placement: str) -> None:
    """estimate's optimizer state (device and host) equals what the built optimizer holds after its step."""
    cls, kwargs = CLASSES[name]
    choices = Choices(optimizer=OptimizerChoice(name=cls, kwargs=kwargs, placement=placement))
    model = make_mlp()
    report = estimate(model, torch.randn(8, 16), device="cpu", setup=choices)
    fraction = {"device": {}, "offload": {"offload_fraction": 1.0}}[placement]
    _, opt = _train(lambda m: build_optimizer(m.named_parameters(), lr=LR, weight_decay=WD, optimizer_class=cls,
                                              optimizer_kwargs=kwargs, **fraction))
    measured = optimizer_state_bytes(opt)
    assert report.optimizer_state_bytes == measured  # wherever it lives
    if placement == "offload":
        assert report.host_bytes > measured  # the state in host RAM, beside the fp32 masters and gradient buffers
    if hasattr(opt, "close"):
        opt.close()


def test_estimate_names_torch_optimizers_through_the_same_probe() -> None:
    model = make_mlp()
    by_name = estimate(model, torch.randn(8, 16), device="cpu", optimizer="adafactor")
    by_path = estimate(model, torch.randn(8, 16), device="cpu", optimizer="torch.optim.Adafactor")
    assert by_name.optimizer_state_bytes == by_path.optimizer_state_bytes > 0
    with pytest.raises(ConfigError, match="optimizer='no.such.Thing'"):
        estimate(model, torch.randn(8, 16), device="cpu", optimizer="no.such.Thing")


# -- the accumulator's contract -----------------------------------------------------------------------------
def test_each_optimizer_declares_its_traits() -> None:
    from memtrain.optim.contract import OptimizerTraits

    model = make_mlp()
    assert OptimizerTraits.of(torch.optim.SGD(model.parameters(), lr=LR)) == OptimizerTraits()
    assert OptimizerTraits.of(torch.optim.AdamW(model.parameters(), lr=LR, fused=True)).takes_skip_flag
    host = CPUOffloadOptimizer(model.named_parameters(), lr=LR)
    traits = OptimizerTraits.of(host)
    assert traits.manages_gradients and traits.found_inf_before_step and not traits.steps_in_backward
    host.close()
    for name, guards in (("adamw", True), ("adafactor", False)):
        opt = build_optimizer(make_mlp().named_parameters(), lr=LR, optimizer_class=name, step_in_backward=True)
        traits = OptimizerTraits.of(opt)
        assert traits.steps_in_backward and not traits.manages_gradients
        assert traits.guards_non_finite is guards, name  # only fused AdamW stops the later parameters on inf
        opt.close()


@pytest.mark.parametrize("wrapper", ["device", "partial", "host"])
def test_a_named_class_under_the_accumulator_equals_its_plain_loop(wrapper: str) -> None:
    """Two micro-batches a window, sum-reduced and clipped: the accumulator's factor and clip reach a named class
    as they reach AdamW (through the host step where gradients live on the host). Within 1e-6: the host folds
    the factor and the clip into one multiplier."""
    from memtrain.accumulation import GradientAccumulator

    data = batches(6)

    def run(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        acc = GradientAccumulator(model, opt, steps=2, max_grad_norm=0.5)
        for m, (x, y) in enumerate(data):
            with acc.micro_batch(is_last=m % 2 == 1):
                acc.backward(((model(x) - y) ** 2).sum(), reduction="sum", items=x.shape[0])
            if m % 2 == 1:
                acc.step()

    ref = make_mlp()
    run(_plain(NamedOptimizer.of("adafactor"), ref), ref)
    ours = make_mlp()
    opt = build_optimizer(ours.named_parameters(), lr=LR, weight_decay=WD, optimizer_class="adafactor",
                          **WRAPPERS[wrapper])
    run(opt, ours)
    assert _diff(ref, ours) < 1e-6, _diff(ref, ours)
    opt.close()


def test_the_runs_betas_and_eps_reach_a_class_that_takes_them_in_the_same_form():
    """--adam-betas and --adam-eps are the run's, not dropped: Adam and Lion take them; Adafactor (no betas, an eps
    pair) and CAME (three betas) keep their own; the class's kwargs win."""
    run = {"lr": LR, "weight_decay": WD, "betas": (0.5, 0.6), "eps": 1e-3}
    assert NamedOptimizer.of("adam").hyperparameters(**run) == run
    assert NamedOptimizer.of("lion").hyperparameters(**run) == {"lr": LR, "weight_decay": WD, "betas": (0.5, 0.6)}
    assert NamedOptimizer.of("adafactor").hyperparameters(**run) == {"lr": LR, "weight_decay": WD}
    assert "betas" not in NamedOptimizer.of("came").hyperparameters(**run)
    assert NamedOptimizer.of("adam", {"betas": (0.9, 0.99)}).hyperparameters(**run)["betas"] == (0.9, 0.99)
    opt = build_optimizer(make_mlp().named_parameters(), lr=LR, betas=(0.5, 0.6), eps=1e-3, optimizer_class="adam")
    inner = next(iter(opt._inner.values()))
    assert inner.defaults["betas"] == (0.5, 0.6) and inner.defaults["eps"] == 1e-3
    opt.close()


def test_a_kept_optimizer_is_the_runs_own_unless_another_is_named():
    """A resume or re-plan keeps the run's class: an unset name inherits it (as the other optimizer fields do);
    another class, or other kwargs of it, are refused, naming what differs."""
    from memtrain.planner.settings import PlanSettings
    from memtrain.run.replan import check_kept_optimizer

    kept = PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep",), flavor="full", chunked_loss=False,
                        optimizer="device", distribution="none", compile=False,
                        optimizer_class=NamedOptimizer.of("adafactor", {"beta2_decay": -0.5}))
    check_kept_optimizer(Choices(), kept)
    check_kept_optimizer(Choices(optimizer=OptimizerChoice(name="adafactor", kwargs={"beta2_decay": -0.5})), kept)
    with pytest.raises(ConfigError, match="optimizer.name='lion'.*Adafactor"):  # as the run names it
        check_kept_optimizer(Choices(optimizer=OptimizerChoice(name="lion")), kept)
    with pytest.raises(ConfigError, match=r"optimizer.kwargs=\{'beta2_decay': -0.8\}"):
        check_kept_optimizer(Choices(optimizer=OptimizerChoice(name="adafactor", kwargs={"beta2_decay": -0.8})), kept)


def test_an_explicit_foreach_counts_the_multi_tensor_scratch():
    """foreach=True in the kwargs is the multi-tensor step, as torch's default on CUDA: its scratch covers every
    parameter at once, not the largest alone."""
    params = [(1024 * 1024, torch.float32)] * 10
    shapes = [(1024, 1024)] * 10

    def scratch(kwargs: dict) -> int:
        return optimizer_memory(params, named=NamedOptimizer.of("adafactor", kwargs), shapes=shapes,
                                device_type="cuda").device_step_temp_bytes

    assert scratch({"foreach": True}) == scratch({}) > 5 * scratch({"foreach": False})


@pytest.mark.parametrize("wrapper", ["device", "host"])
def test_a_named_state_for_other_shapes_is_one_clear_error(wrapper: str) -> None:
    """A Lion state saved for an 8x8 layer does not load into an 8x16 one (its bytes against the probe's): one
    ConfigError naming the parameter, not a raw size mismatch at the next step."""
    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model.named_parameters(), lr=LR, optimizer_class="lion", **WRAPPERS[wrapper])

    small, wide = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)
    opt = build(small)
    small(torch.randn(2, 8)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    with pytest.raises(ConfigError, match=r"(?s)state of 'weight' holds .* bytes.*To resolve this error"):
        build(wide).load_state_dict(saved)
    assert saved["state"]["weight"]["exp_avg"].device.type == "cpu"


class _TakesAMapping(torch.optim.SGD):
    """An optimizer class with a mapping-valued hyper-parameter (as some schedulers-in-optimizers have)."""

    def __init__(self, params, lr: float = 1e-3, schedule: dict | None = None) -> None:
        assert isinstance(schedule, dict), schedule  # the class gets the dict it was named with
        self.schedule = schedule
        super().__init__(params, lr=lr)


def test_a_mapping_valued_kwarg_keeps_the_name_hashable_and_reaches_the_class_as_a_dict() -> None:
    choice = OptimizerChoice(name=_TakesAMapping, kwargs={"schedule": {"warm": [1, 2], "decay": 0.5}})
    assert hash(choice) == hash(OptimizerChoice(name=_TakesAMapping, kwargs={"schedule": {"decay": 0.5,
                                                                                           "warm": (1, 2)}}))
    named = choice.named
    assert named.state_sizes((4, 4), torch.float32) == ()  # plain SGD: no state; the probe caches by the kwargs
    opt = named.resolve()([torch.nn.Parameter(torch.zeros(2))], **named.hyperparameters(lr=0.1, weight_decay=0.0))
    assert opt.schedule == {"warm": (1, 2), "decay": 0.5}


def test_probes_from_two_threads_take_turns_at_the_profiler() -> None:
    """torch's profiler is one per process: two probes at once (two planners in threads) must not collide."""
    from concurrent.futures import ThreadPoolExecutor

    from memtrain.measure import cpu_allocation_peak_bytes

    def probe(_: int) -> int:
        return cpu_allocation_peak_bytes(lambda: torch.ones(1 << 20).sum())

    with ThreadPoolExecutor(4) as pool:
        peaks = list(pool.map(probe, range(8)))
    assert all(p >= 4 << 20 for p in peaks), peaks
