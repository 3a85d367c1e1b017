"""TrainConfig (memtrain.config): every problem of a config found at once, each named as the argument and saying
how to resolve it."""

from __future__ import annotations

import pytest

from memtrain import ConfigError, TrainConfig
from memtrain.choices import Choices, OptimizerChoice


def test_train_config_lists_every_problem():
    with pytest.raises(ConfigError) as info:
        TrainConfig(max_steps=0, lr=-1.0, precision="fp8", resume=True, overwrite=True).validate()
    assert len(info.value.problems) == 5, info.value.problems


def test_every_train_config_problem_says_how_to_resolve_it():
    bad = dict(max_steps=0, micro_batch_size=0, lr=-1.0, warmup_steps=-1, seed=-1, min_lr_ratio=2.0,
               weight_decay=-1.0, grad_clip=0.0, safety_margin=2.0, precision="fp8", sample_bytes=True,
               budget="lots", choices={"chunked_loss": True})
    with pytest.raises(ConfigError) as info:
        TrainConfig(**bad).validate()
    assert len(info.value.problems) >= len(bad), info.value.problems
    assert all("To resolve this error" in p for p in info.value.problems), info.value.problems
    # The techniques' own values are checked where they are built: Choices, each problem with its fix.
    bad_choices = dict(compile="yes", chunked_loss="yes", checkpointing=True)
    with pytest.raises(ConfigError) as info:
        Choices(**bad_choices)
    assert len(info.value.problems) >= len(bad_choices), info.value.problems
    with pytest.raises(ConfigError) as info:
        OptimizerChoice(state_precision="fp8", offload_fraction=2.0)
    assert len(info.value.problems) == 2, info.value.problems
    assert all("To resolve this error" in p for p in info.value.problems), info.value.problems


def test_train_config_errors_name_arguments_and_suggest_only_what_it_accepts():
    bad = TrainConfig(max_steps=0, lr=float("nan"), seed=-1, precision="fp8", overwrite=True, resume=True,
                      choices=Choices(optimizer=OptimizerChoice(placement="offload-bf16-weights")), fsdp=True,
                      warmup_steps=-1)
    with pytest.raises(ConfigError) as info:
        bad.validate()
    problems = info.value.problems
    assert not [p for p in problems if "--" in p], problems  # flags are the CLI's words, not the library's
    assert any("out_dir='DIR'" in p for p in problems), problems
    assert any("optimizer.placement='offload-bf16-weights' with fsdp=True" in p for p in problems), problems
    with pytest.raises(ConfigError) as info:
        Choices(checkpointing="sometimes")
    checkpointing = next(p for p in info.value.problems if p.startswith("checkpointing="))
    assert "'every:K'" in checkpointing and "'selective'" in checkpointing, checkpointing
    for accepted in ("every:2", "selective", "blocks(RK)", "all+offload", "auto"):  # what the message suggests
        TrainConfig(choices=Choices(checkpointing=accepted)).validate()


@pytest.mark.parametrize("value", [{"checkpointing": "all"}, "all", None])
def test_choices_that_are_not_a_choices_are_one_error_naming_it(value):
    with pytest.raises(ConfigError) as info:
        TrainConfig(choices=value).validate()
    (problem,) = info.value.problems
    assert problem.startswith(f"choices={value!r} is not a Choices"), problem
    assert "Choices(" in problem and "Choices.from_dict(" in problem, problem
    TrainConfig(choices=Choices.from_dict({"checkpointing": "all"})).validate()  # the fix it names


def test_the_world_size_rule_waits_for_the_world_but_fsdp_is_checked_at_once():
    in_backward = TrainConfig(choices=Choices(optimizer=OptimizerChoice(step_in_backward=True)))
    in_backward.validate()  # one process is fine; train / plan_for_run check it against the ranks
    with pytest.raises(ConfigError, match="optimizer.step_in_backward=True with world_size=2"):
        in_backward.choices.check_run(world_size=2, fsdp=in_backward.fsdp)


def test_to_dict_writes_the_choices_as_json_values():
    config = TrainConfig(choices=Choices(checkpointing="every:2", optimizer=OptimizerChoice(placement="offload")))
    saved = config.to_dict()
    assert saved["choices"]["checkpointing"] == "every:2" and saved["choices"]["optimizer"]["placement"] == "offload"
    assert Choices.from_dict(saved["choices"]) == config.choices and saved["max_steps"] == config.max_steps


def test_a_technique_field_of_trainconfig_is_an_unknown_field_naming_choices():
    """The techniques are one field, ``choices``: a flat technique keyword (the unreleased 0.1.0's spelling, or a
    typo) is the ConfigError of an unknown field, naming the known ones and the ``choices=`` fix, not a TypeError."""
    with pytest.raises(ConfigError, match=r"TrainConfig: unknown field checkpoint_every\. To resolve this error, "
                       r"use the fields TrainConfig has \(max_steps, .*choices, .*\);.* pass choices=Choices\("):
        TrainConfig(checkpoint_every=2)
    with pytest.raises(ConfigError, match="unknown fields checkpointing, offload_optimizer"):
        TrainConfig(max_steps=3, offload_optimizer=True, checkpointing="every")
    assert TrainConfig(max_steps=3, choices=Choices(checkpointing="every:2")).max_steps == 3  # known ones still pass
