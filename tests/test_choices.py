"""memtrain.choices: one typed value for the technique choices, parsed once and checked once."""

from __future__ import annotations

import json

import pytest

from memtrain.checkpointing import Checkpointing
from memtrain.choices import Choices, OptimizerChoice, default_global_batch
from memtrain.errors import ConfigError
from memtrain.techniques import activation_offload


def test_checkpointing_is_parsed_once_at_construction():
    assert Choices().checkpointing is None
    assert Choices(checkpointing="auto").checkpointing is None
    assert Choices(checkpointing="every:2").checkpointing == Checkpointing(mode="every", every=2)
    assert Choices(checkpointing=" All+Offload ").checkpointing == Checkpointing(mode="all", offload_inputs=True)
    policy = Checkpointing(mode="blocks", blocks=("recompute", "keep"))
    assert Choices(checkpointing=policy).checkpointing is policy


def test_choices_round_trip_through_json():
    choices = Choices(checkpointing="selective", offload_activations=False, chunked_loss=True, compile=True,
                      optimizer=OptimizerChoice(placement="device", state_precision="int8", offload_fraction=0.25))
    assert Choices.from_dict(json.loads(json.dumps(choices.to_dict()))) == choices
    assert Choices.from_dict({"optimizer": {"placement": "offload"}}).optimizer == OptimizerChoice(placement="offload")


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(checkpointing="every:0"), "checkpointing="),
    (dict(checkpointing=3), "is not a policy"),
    (dict(offload_activations="yes"), "offload_activations='yes' must be True, False, or None"),
    (dict(chunked_loss=1), "chunked_loss=1 must be True, False, or None"),
    (dict(compile=None), "compile=None must be True or False"),
    (dict(optimizer="offload"), "is not an OptimizerChoice"),
    (dict(checkpointing="all+offload", offload_activations=False), "drop +offload or offload_activations=False"),
])
def test_bad_choices_fail_at_construction_naming_the_fix(kwargs, needle):
    with pytest.raises(ConfigError, match="To resolve this error") as info:
        Choices(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(placement="host"), "optimizer.placement='host' is not one of"),
    (dict(state_precision="fp8"), "optimizer.state_precision='fp8' is not one of"),
    (dict(step_in_backward="on"), "optimizer.step_in_backward='on' must be True, False, or None"),
    (dict(offload_fraction=1.5), "optimizer.offload_fraction=1.5 must be a fraction in [0, 1]"),
    (dict(placement="offload", offload_fraction=0.5), "pass one of them"),
    (dict(placement="offload", step_in_backward=True), "step_in_backward is for the device optimizer"),
    (dict(step_in_backward=True, offload_fraction=0.5), "a partial offload steps after backward"),
])
def test_contradicting_optimizer_choices_fail_naming_the_fix(kwargs, needle):
    with pytest.raises(ConfigError, match="To resolve this error") as info:
        OptimizerChoice(**kwargs)
    assert needle in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        Choices(checkpointing="sometimes", offload_activations="yes", compile="no")
    assert len(info.value.problems) == 3, info.value.problems


def test_unknown_fields_name_the_known_ones():
    with pytest.raises(ConfigError, match="unknown field offload_optimizer.*checkpointing, offload_activations"):
        Choices.from_dict({"offload_optimizer": True})
    with pytest.raises(ConfigError, match="unknown field fraction.*placement, state_precision"):
        Choices.from_dict({"optimizer": {"fraction": 0.5}})


def test_a_run_of_several_processes_refuses_what_it_cannot_take():
    Choices(optimizer=OptimizerChoice(placement="offload")).check_run(world_size=2)
    Choices(optimizer=OptimizerChoice(placement="offload")).check_run(world_size=2, fsdp=True)  # CPUOffloadPolicy
    with pytest.raises(ConfigError, match="FSDP2 offloads its shards as they are stored"):
        Choices(optimizer=OptimizerChoice(placement="offload-bf16-weights")).check_run(world_size=2, fsdp=True)
    with pytest.raises(ConfigError, match="optimizer.step_in_backward=True with world_size=2"):
        Choices(optimizer=OptimizerChoice(step_in_backward=True)).check_run(world_size=2)
    Choices(optimizer=OptimizerChoice(step_in_backward=True)).check_run(world_size=1)


def test_in_backward_steps_fix_a_device_optimizer_and_lean_state_goes_with_either():
    assert OptimizerChoice().fixed_placement is None
    assert OptimizerChoice(state_precision="bf16").fixed_placement is None  # bf16 moments on the device or the host
    assert OptimizerChoice(placement="offload", state_precision="int8").fixed_placement == "offload"
    assert OptimizerChoice(step_in_backward=True).fixed_placement == "device"
    assert OptimizerChoice(offload_fraction=0.0).fixed_placement == "device"
    assert OptimizerChoice(step_in_backward=False).fixed_placement is None
    assert OptimizerChoice(placement="offload").fixed_placement == "offload"


def test_activation_offload_asked_for_by_the_policy_or_directly():
    assert activation_offload.asked(Choices()) is None
    assert activation_offload.asked(Choices(checkpointing="all+offload")) is True
    assert activation_offload.asked(Choices(offload_activations=False)) is False


def test_one_default_global_batch():
    assert default_global_batch(1) == 16
    assert default_global_batch(4) == 64
    assert default_global_batch(2, micro_batch_size=3) == 6
