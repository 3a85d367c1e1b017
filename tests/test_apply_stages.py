"""``apply_plan`` as a pipeline of per-technique stages (``memtrain.planner.apply.STAGES``): every technique of the
registry has its stage (or is applied by another's, said in one place), the stages run in the documented order, and
the order matters: with a stage moved, the device holds fp32 weights the plan keeps in bf16 (fault injection)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_gpt

from memtrain.device import simulate
from memtrain.errors import ConfigError
from memtrain.planner import PlanSettings, apply_plan, configure_model
from memtrain.planner import apply as applying
from memtrain.planner.apply import APPLIED_BY, MODEL_STAGES, NOT_TECHNIQUES, STAGES, Applying, Stage
from memtrain.techniques import REGISTRY

# The order the module's and apply_plan's docstrings say, by stage.
DOCUMENTED = ("activation_checkpointing", "chunked_loss", "tiled_mlp", "kv_cache_off", "pure_bf16",
              "offloaded_optimizer", "placement", "parameter_offload", "data_parallelism", "torch_compile", "device_optimizer",
              "gradient_accumulation")
# Each constraint of the order: (this stage, before that one, why).
BEFORE = (
    ("activation_checkpointing", "torch_compile", "compile takes the wrapped blocks (per block where they offload)"),
    ("chunked_loss", "torch_compile", "compile takes the chunked head as it is"),
    ("tiled_mlp", "data_parallelism", "DDP and FSDP2 wrap the blocks whose MLPs are tiled"),
    ("activation_checkpointing", "data_parallelism", "FSDP2 shards the blocks as they are wrapped"),
    ("pure_bf16", "offloaded_optimizer", "pure bf16's optimizer keeps no master: the bf16 weights are its own"),
    ("pure_bf16", "placement", "the device never holds pure bf16's weights in fp32"),
    ("offloaded_optimizer", "placement", "the master takes the host weights' digits, then the device copies bf16"),
    ("offloaded_optimizer", "parameter_offload", "the blocks' weights stream from its host weights"),
    ("placement", "parameter_offload", "the placement leaves the streamed weights on the host"),
    ("offloaded_optimizer", "data_parallelism", "DDP buckets the weights as the optimizer leaves them"),
    ("placement", "data_parallelism", "DDP broadcasts the device weights"),
    ("data_parallelism", "torch_compile", "compile takes the wrapped module"),
    ("data_parallelism", "device_optimizer", "a device optimizer holds FSDP2's sharded parameters"),
    ("torch_compile", "gradient_accumulation", "the accumulator calls the compiled module"),
    ("device_optimizer", "gradient_accumulation", "the accumulator steps the optimizer"),
)


def _settings(optimizer: str = "device", **overrides) -> PlanSettings:
    fields = dict(micro_batch_size=2, accumulation=1, blocks=("recompute",) * 4, flavor="full", chunked_loss=False,
                  optimizer=optimizer, distribution="none", compile=False, precision="bf16-mixed")
    return PlanSettings(**{**fields, **overrides})


def _moved(name: str, *, before: str | None = None, after: str | None = None) -> tuple[Stage, ...]:
    """``STAGES`` with the stage ``name`` moved to just before the stage ``before`` or just after ``after`` (a wrong
    order)."""
    stages = [s for s in STAGES if s.run.__name__ != name]
    at = next(i for i, s in enumerate(stages) if s.run.__name__ == (before or after)) + (after is not None)
    return (*stages[:at], next(s for s in STAGES if s.run.__name__ == name), *stages[at:])


def _close(run) -> None:
    if hasattr(run.optimizer, "close"):
        run.optimizer.close()


# -- every technique has a stage --------------------------------------------------------------------------------
def test_every_technique_has_a_stage_or_is_applied_by_another():
    techniques = {t.name for t in REGISTRY}
    staged = {s.technique for s in STAGES}
    assert staged - techniques <= set(NOT_TECHNIQUES), f"stages of no technique: {staged - techniques}"
    assert techniques - staged == set(APPLIED_BY), (
        f"techniques without a stage: {techniques - staged - set(APPLIED_BY)}; declared applied by another but "
        f"with their own stage: {set(APPLIED_BY) & staged}")
    for technique, by in APPLIED_BY.items():
        assert by in staged and by in techniques, (technique, by)
    assert set(NOT_TECHNIQUES) <= staged
    assert all(s.run.__doc__ for s in STAGES), [s.run.__name__ for s in STAGES if not s.run.__doc__]
    assert STAGES[:len(MODEL_STAGES)] == MODEL_STAGES


# -- the order --------------------------------------------------------------------------------------------------
def test_the_stages_are_in_the_documented_order():
    order = [s.run.__name__ for s in STAGES]
    assert tuple(order) == DOCUMENTED, order
    broken = [(a, b, why) for a, b, why in BEFORE if order.index(a) > order.index(b)]
    assert not broken, broken


def test_apply_plan_runs_every_stage_once_in_order_and_configure_model_the_model_stages(monkeypatch):
    ran: list[str] = []

    def recording(stage: Stage) -> Stage:
        def run(a: Applying) -> None:
            ran.append(stage.run.__name__)
            stage.run(a)

        return Stage(stage.technique, run)

    monkeypatch.setattr(applying, "STAGES", tuple(recording(s) for s in STAGES))
    monkeypatch.setattr(applying, "MODEL_STAGES", tuple(recording(s) for s in MODEL_STAGES))
    model = tiny_gpt(4, seed=0)
    _close(apply_plan(model, _settings(), lr=1e-3))
    assert tuple(ran) == DOCUMENTED, ran
    ran.clear()
    assert configure_model(model, _settings()) == [f"blocks.{i}" for i in range(4)]
    assert tuple(ran) == DOCUMENTED[:4], ran


def test_a_stage_with_nothing_to_do_leaves_the_model_as_it_is():
    """Plain settings (no pure bf16, a device optimizer, no streaming, one process, no compile): the stages of the
    techniques they do not use change nothing and produce nothing."""
    model = tiny_gpt(4, seed=0)
    before = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
    a = Applying(model, _settings(), [f"blocks.{i}" for i in range(4)])
    for stage in (applying.pure_bf16, applying.offloaded_optimizer, applying.parameter_offload,
                  applying.data_parallelism, applying.torch_compile):
        stage(a)
    assert a.optimizer is None and a.weights is None and a.train_model is model
    assert {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()} == before


# -- behaviour a wrong order would break ------------------------------------------------------------------------
def _offloaded_bf16_weights(monkeypatch, stages: tuple[Stage, ...]) -> tuple[int, int, int, list[str]]:
    """offload-bf16-weights applied on a simulated device by ``stages``: the device's peak, what it holds after,
    the model's fp32 bytes, and the weights whose master lost the host weights' digits."""
    monkeypatch.setattr(applying, "STAGES", stages)
    model = tiny_gpt(4, seed=0)
    host = {n: p.detach().clone() for n, p in model.named_parameters()}
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    with simulate("8MiB") as acc:
        run = apply_plan(model, _settings("offload-bf16-weights"), lr=1e-3)
        peak, held = acc.max_memory_allocated(), acc.memory_allocated()
        lost = [s.key for s in run.optimizer.slots if not torch.equal(s.master, host[s.key])]
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        run.optimizer.close()
    return peak, held, fp32, lost


def test_the_offloaded_optimizer_takes_its_master_before_the_device_weights_become_bf16_and_are_placed(
        monkeypatch):
    """offload-bf16-weights: the fp32 master keeps the host weights' full digits, and the device never holds more
    than the bf16 weights it keeps (no fp32 copy placed first)."""
    peak, held, fp32, lost = _offloaded_bf16_weights(monkeypatch, STAGES)
    assert not lost, f"masters that lost the host weights' digits: {lost}"
    assert peak == held < fp32, f"device peak {peak} B, held after {held} B, fp32 weights {fp32} B"


def test_the_placement_before_the_offloaded_optimizer_holds_fp32_weights_on_the_device(monkeypatch):
    """Fault injection for the check above: the placement moved before the offloaded optimizer places the fp32
    weights, which it then casts: the peak is over what the device keeps."""
    peak, held, fp32, _ = _offloaded_bf16_weights(monkeypatch, _moved("placement", before="offloaded_optimizer"))
    assert peak >= fp32 > held, f"device peak {peak} B, held after {held} B, fp32 weights {fp32} B"


def _fp32_placed(monkeypatch, stages: tuple[Stage, ...], optimizer: str) -> tuple[int, int]:
    """Pure bf16 applied on a simulated device by ``stages``: the fp32 elements placed on it (every ``acc.place``
    counted), and the model's fp32 buffers' (which keep their dtype)."""
    monkeypatch.setattr(applying, "STAGES", stages)
    model = tiny_gpt(4, seed=0)
    model.register_buffer("scale", torch.ones(16))  # an fp32 buffer: pure bf16 casts the weights, not the buffers
    buffers = sum(b.numel() for b in model.buffers() if b.dtype == torch.float32)
    placed: list[torch.Tensor] = []
    with simulate("8MiB") as acc:
        place = acc.place

        def counted(tensor):
            placed.append(tensor)
            return place(tensor)

        monkeypatch.setattr(acc, "place", counted)
        _close(apply_plan(model, _settings(optimizer, pure_bf16=True), lr=1e-3))
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.scale.dtype == torch.float32
    return sum(t.numel() for t in placed if t.dtype == torch.float32), buffers


@pytest.mark.parametrize("optimizer", ["offload", "device"])
def test_pure_bf16_never_places_fp32_weights(monkeypatch, optimizer):
    fp32, buffers = _fp32_placed(monkeypatch, STAGES, optimizer)
    assert fp32 == buffers > 0, f"fp32 elements placed {fp32}, of them the fp32 buffers' {buffers}"


def test_pure_bf16_cast_after_the_placement_places_fp32_weights(monkeypatch):
    """Fault injection for the check above: pure bf16's cast moved after the placement places the fp32 weights (with
    a device optimizer: the offloaded one refuses weights that are not bf16 yet)."""
    fp32, buffers = _fp32_placed(monkeypatch, _moved("pure_bf16", after="placement"), "device")
    weights = sum(p.numel() for p in tiny_gpt(4, seed=0).parameters())
    assert fp32 >= buffers + weights, f"fp32 elements placed {fp32}, the buffers' {buffers}, the weights' {weights}"


def test_a_plan_for_another_process_group_leaves_the_model_as_it_was():
    """The plan is checked against the process group before any stage: a DDP plan in one process is refused with
    the model's weights and blocks as they were (pure bf16's cast and checkpointing's wrappers not applied)."""
    model = tiny_gpt(4, seed=0)
    modules = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ConfigError, match="the plan's distribution is 'ddp', and this process group has 1 rank"):
        apply_plan(model, _settings(distribution="ddp", pure_bf16=True), lr=1e-3)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert [(n, type(m)) for n, m in model.named_modules()] == modules


@pytest.mark.parametrize("overrides,rule", [
    (dict(optimizer="offload", offload_weights=True, compile=True), "offload_weights=True with compile=True"),
    (dict(pure_bf16=True, precision="fp32"), "pure_bf16=True with precision='fp32'"),
    (dict(optimizer="offload", step_in_backward=True), "optimizer='offload' with step_in_backward=True"),
])
def test_a_hand_made_set_up_that_a_rule_refuses_is_refused_before_anything_is_applied(overrides, rule):
    """``apply_plan`` holds a hand-made ``PlanSettings`` to the rules a plan obeys: compiled with streamed weights,
    it failed inside torch.compile at the first step; the others trained as if allowed."""
    model = tiny_gpt(4, seed=0)
    modules = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ConfigError, match=f"^apply_plan: {rule}"):
        apply_plan(model, _settings(**overrides), lr=1e-3)
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
