"""Tests of memtrain.planner: Plan: its summary, JSON and host-link bytes."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
from helpers import MiB, fields_form, h100

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.models import GPT, GPTConfig
from memtrain.planner import (
    TECHNIQUES,
    Fixed,
    PlanSettings,
    plan,
    predictions,
)

transformers = pytest.importorskip("transformers")

H100 = h100()




# -- bytes over the host link, and what compile_model compiles ------------------------------------------------
def _offload_gpt() -> GPT:
    # Block inputs of 256 x 256 fp32 per example: 256 KiB at micro-batch 1, the offloader's 1 MiB at 4.
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, seq_len=256, vocab_size=256, dropout=0.0))


def test_summary_and_json(llama):
    p = plan(llama, budget=int(160 * MiB), seq_len=1024, global_batch_size=4, device_profile=H100)
    table = p.summary()
    assert "choice:" in table and "runners-up" in table and "because:" in table, table
    doc = json.loads(json.dumps(p.to_dict()))
    assert set(doc) >= {"plan", "peak_bytes", "step_seconds", "tokens_per_s", "candidates", "reasons"}
    assert doc["plan"]["micro_batch_size"] == p.micro_batch_size and doc["candidates"]
    assert all(c["lost_because"] for c in doc["candidates"])


def test_a_plan_reports_its_host_link_bytes():
    model = _offload_gpt()
    s = PlanSettings(micro_batch_size=4, accumulation=1, blocks=("offload", "keep"), flavor="full",
                     chunked_loss=False, optimizer="offload", distribution="none", compile=False, precision="fp32")
    p = plan(model, budget=None, seq_len=256, global_batch_size=4, device_profile=H100, settings=s,
             host_budget="64GiB")
    (c,) = predictions(model, [s], seq_len=256, global_batch_size=4, device="cuda", device_profile=H100)
    assert p.host_link == c.host_link and p.host_link_bytes == c.host_link.total > 0
    assert all(r.host_link is not None for r in p.candidates)
    assert p.host_link.activations_to_host > 0 and p.host_link.optimizer_to_host > 0, p.host_link
    assert json.loads(json.dumps(p.to_dict()))["host_link"] == p.host_link.to_dict()
    assert "host link per step:" in p.summary(), p.summary()


# -- the one translation of a run's choices into the plan's fixed choices -------------------------------------
def test_offload_activations_with_a_fixed_layout_offloads_what_it_keeps_and_the_recomputed_inputs():
    # The CLI's documented meaning; TrainConfig's path (the old of_choices) kept the kept blocks on the device.
    fixed, allowed, notes = Fixed.of_choices(Choices(checkpointing="every:2", offload_activations=True), n_blocks=4,
                                             device="cuda")
    assert fixed.blocks == ("recompute", "offload", "recompute", "offload") and fixed.flavor == "offload-inputs"
    assert "offload-activations" in allowed and not notes
    # "+offload" alone offloads the recomputed blocks' inputs; the kept blocks stay kept.
    fixed, _, _ = Fixed.of_choices(Choices(checkpointing="every:2+offload"), n_blocks=4, device="cuda")
    assert fixed.blocks == ("recompute", "keep", "recompute", "keep") and fixed.flavor == "offload-inputs"
    # With the layout left to the plan, it fixes how the recomputed blocks recompute (inputs offloaded).
    fixed, _, _ = Fixed.of_choices(Choices(offload_activations=True), n_blocks=4, device="cuda")
    assert (fixed.blocks, fixed.flavor) == (None, "offload-inputs")
    fixed, allowed, _ = Fixed.of_choices(Choices(offload_activations=False), n_blocks=4, device="cuda")
    assert fixed == Fixed() and "offload-activations" not in allowed


def test_a_plan_keeps_a_fixed_layout_and_offloads_what_it_keeps(llama):
    p = plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100,
             choices=Choices(checkpointing="every:2", offload_activations=True))
    assert p.settings.blocks == ("recompute", "offload", "recompute", "offload"), p.summary()
    assert p.settings.flavor == "offload-inputs"


def test_activation_offload_on_a_cpu_is_off_with_a_note():
    fixed, allowed, notes = Fixed.of_choices(Choices(checkpointing="all+offload", offload_activations=True),
                                             n_blocks=2, device="cpu")
    assert (fixed.blocks, fixed.flavor) == (("recompute", "recompute"), "full")
    assert "offload-activations" not in allowed and "no effect on a CPU-only run" in notes[0]
    p = plan(_offload_gpt(), budget=None, seq_len=64, global_batch_size=2, device="cpu", precision="fp32",
             choices=Choices(offload_activations=True))
    assert "no effect on a CPU-only run" in p.reasons[0] and "offload" not in p.settings.blocks, p.reasons


@pytest.mark.parametrize("policy, match", [("selective(matmul)", "keeps the outputs of matmul, attention"),
                                           ("selective+offload", "does not combine a selective recompute")])
def test_a_selective_policy_the_planner_cannot_plan_is_a_clear_error(policy, match):
    with pytest.raises(ConfigError, match=match) as info:
        Fixed.of_choices(Choices(checkpointing=policy), n_blocks=2, device="cuda")
    assert "To resolve this error" in str(info.value)
    fixed, _, _ = Fixed.of_choices(Choices(checkpointing="selective"), n_blocks=2, device="cuda")
    assert (fixed.blocks, fixed.flavor) == (("recompute", "recompute"), "selective")


def test_compile_and_the_loss_are_fixed_as_given():
    assert Fixed.of_choices(Choices(), n_blocks=2, device="cuda") == (Fixed(), frozenset(TECHNIQUES), [])
    fixed, _, _ = Fixed.of_choices(Choices(compile=True, chunked_loss=False), n_blocks=2, device="cuda")
    assert (fixed.compile, fixed.chunked_loss) == (True, False)
    with pytest.raises(ConfigError, match=r"is not a Choices.*Choices\.from_dict"):
        Fixed.of_choices({"compile": True}, n_blocks=2, device="cuda")  # type: ignore[arg-type]


_OPTIMIZER_VALUES = dict(placement=(None, "device", "offload"), state_precision=(None, "fp32", "bf16", "int8"),
                         step_in_backward=(None, False, True), offload_fraction=(None, 0.0, 0.5, 1.0))


def test_every_optimizer_choice_is_translated():
    built = 0
    for values in itertools.product(*_OPTIMIZER_VALUES.values()):
        given = dict(zip(_OPTIMIZER_VALUES, values, strict=True))
        try:
            choice = OptimizerChoice(**given)
        except ConfigError:  # a contradiction: Choices' to name (tests/test_choices.py)
            continue
        built += 1
        fixed, allowed, _ = Fixed.of_choices(Choices(optimizer=choice), n_blocks=2, device="cuda")
        # An in-backward step and an offloaded share are device optimizers (lean moments go with either); a device
        # optimizer keeps no share of its state on the host unless given one, and never offloads.
        device = given["placement"] == "device" or (
            given["placement"] is None and (given["step_in_backward"] or given["offload_fraction"] is not None))
        expected = "device" if device else given["placement"]
        fraction = 0.0 if given["placement"] == "device" and given["offload_fraction"] is None else (
            given["offload_fraction"])
        assert (fixed.optimizer, fixed.state_precision, fixed.step_in_backward, fixed.offload_fraction) == (
            expected, given["state_precision"], given["step_in_backward"], fraction), given
        assert (fixed.blocks, fixed.flavor, fixed.chunked_loss, fixed.compile) == (None, None, None, None)
        off = given["placement"] == "device"
        assert ("offload-optimizer" in allowed, "bf16-weights" in allowed) == (not off, not off), given
        assert allowed | {"offload-optimizer", "bf16-weights"} == set(TECHNIQUES)
    assert built == 88, built  # of 144: 3 placements x 4 precisions x 3 switches x 4 fractions


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("micro_batch_size", "4", "an integer"), ("accumulation", 1.5, "an integer"),
    ("distribution", "mpi", "one of 'none'"), ("precision", None, "a string")])
def test_a_saved_plans_value_of_the_wrong_kind_is_refused_naming_the_field(field, value, kind):
    """A plan read back from a checkpoint's dict: each field of the kind its type declares (a string "4" for an
    integer was taken as it was, to fail later where it was used)."""
    saved = PlanSettings(micro_batch_size=1, accumulation=2, blocks=("keep", "recompute"), flavor="full",
                         distribution="none").to_dict()
    assert PlanSettings.from_dict(saved).to_dict() == saved
    with pytest.raises(ConfigError) as info:
        PlanSettings.from_dict({**saved, field: value})
    assert f"{field}=" in str(info.value) and f"(not {kind}" in str(info.value), str(info.value)


@pytest.mark.parametrize(("change", "named"), [
    ({"n_blocks": "2"}, "n_blocks='2' (not a count of blocks)"), ({"n_blocks": -1}, "n_blocks=-1"),
    ({"choices": "none"}, "choices='none' (not a mapping)"), ({"choices": None}, "choices=None"),
    ({"choices": {"chunked_loss": 1}}, "chunked_loss=1"), ({"choices": {"checkpointing": "bogus"}}, "bogus"),
    ({"choices": {"optimiser": {}}}, "optimiser"), ({"n_blocks": None}, "n_blocks=None"),
    # the layout's letters are the block count: another count is another model
    ({"n_blocks": 3}, "n_blocks=3 and choices.checkpointing='blocks(RK)', a layout of 2 blocks"),
    # in the saved form's terms (the user passed no --checkpointing)
    ({"choices": {"checkpointing": "blocks(RX)"}}, "a plan's saved choices: checkpointing='blocks(RX)'"),
    # None is a plan's to choose: read as the plain default it would be another set-up
    ({"choices": {"checkpointing": None}}, "leave checkpointing to a plan (None)"),
    ({"choices": {"optimizer": {"placement": None}}},
     "leave optimizer.placement, optimizer.state_precision, optimizer.step_in_backward, optimizer.offload_fraction "
     "to a plan"),
    ({"choices": {"chunked_loss": None, "offload_weights": None}}, "leave chunked_loss, offload_weights to a plan"),
    ({"micro_batch_size": 0}, "micro_batch_size=0 (not >= 1)"), ({"accumulation": -1}, "accumulation=-1 (not >= 1)"),
    ({"precision": "bf16"}, "precision='bf16' (not one of 'fp32', 'bf16-mixed', 'fp16-mixed')"),
    ({"precision": "fp16-mixed", "choices": {"pure_bf16": True}},
     "that no run can take: pure_bf16=True with precision='fp16-mixed'")])
def test_a_saved_plans_choices_or_block_count_that_are_not_ones_are_refused_naming_them(change, named):
    """The saved choices are read as a config file's (every bad value named), the block count as a count."""
    saved = PlanSettings(micro_batch_size=1, accumulation=2, blocks=("recompute", "keep"), flavor="full",
                         distribution="none").to_dict()
    assert PlanSettings.from_dict({**saved, "choices": {**saved["choices"], "checkpointing": "every:2"}}) == \
        PlanSettings.from_dict(saved) == PlanSettings.from_dict(json.loads(json.dumps(saved)))  # another spelling
    if isinstance(change.get("choices"), dict):  # these choices changed, the others as saved
        change = {**change, "choices": {**saved["choices"], **change["choices"]}}
    with pytest.raises(ConfigError, match=re.escape(named)):
        PlanSettings.from_dict({**saved, **change})
    missing = {k: v for k, v in saved.items() if k != "n_blocks"}
    with pytest.raises(ConfigError, match="not a plan's settings \\(missing n_blocks\\)"):
        PlanSettings.from_dict(missing)


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("micro_batch_size", "4", "an integer"), ("accumulation", 1.5, "an integer"), ("chunked_loss", 1, "True or False"),
    ("optimizer", "host", "one of 'device', 'offload'"), ("offload_fraction", True, "a number"),
    ("blocks", ["keep", "nope"], "a list of one of 'keep'"), ("blocks", "keep", "a list of"),
    ("flavor", None, "one of 'full'")])
def test_a_plan_saved_field_by_field_reads_back_and_its_wrong_kinds_are_refused(field, value, kind):
    """The form each field its own key (a checkpoint of an earlier memtrain) reads as the same set-up, and a value
    of the wrong kind is named as it was."""
    settings = PlanSettings(micro_batch_size=1, accumulation=2, blocks=("keep", "recompute"), flavor="full",
                            distribution="none")
    assert PlanSettings.from_dict(fields_form(settings)) == settings
    with pytest.raises(ConfigError) as info:
        PlanSettings.from_dict({**fields_form(settings), field: value})
    assert f"{field}=" in str(info.value) and f"(not {kind}" in str(info.value), str(info.value)


@pytest.mark.parametrize(("change", "named"), [
    ({"optimizer_class": 5}, "is not a plan's settings (AttributeError"),
    ({"offload_weights": True}, "that no run can take: offload_weights=True with optimizer.placement='device'"),
    ({"pure_bf16": True, "precision": "fp32"}, "that no run can take: pure_bf16=True with precision='fp32'")])
def test_a_plan_saved_field_by_field_that_no_run_can_take_is_refused(change, named):
    """The earlier form read field by field: a value no reader takes, or a set-up a rule refuses (it would not be
    written back), is one ConfigError, never a raw traceback."""
    settings = PlanSettings(micro_batch_size=1, accumulation=2, blocks=("keep", "recompute"), flavor="full",
                            distribution="none")
    with pytest.raises(ConfigError, match=re.escape(named)):
        PlanSettings.from_dict({**fields_form(settings), **change})
