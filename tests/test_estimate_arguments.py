"""estimate's arguments: every problem reported at once, each naming the fix."""

from __future__ import annotations

import pytest
import torch

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.estimate import estimate, trace
from memtrain.estimate.arguments import COMPILE_NOTE
from memtrain.models import GPT, GPT_PRESETS


def test_bad_arguments_are_all_reported_at_once():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as info:
        estimate(model, (2, 16), device="tpu", precision="bf16", optimizer="lionn", checkpointing="sometimes")
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert all("To resolve this error" in p for p in problems)
    assert [p for p in problems if "lionn" in p][0].count("optimizer='lionn'") == 1, problems  # named once
    with pytest.raises(ConfigError, match="micro_batch_size and seq_len"):
        estimate(model)
    with pytest.raises(ConfigError, match="positions"):
        estimate(model, (2, 65), device="cpu")
    with pytest.raises(ConfigError, match="not an nn.Module"):
        estimate("gpt2", (2, 16))


def test_bad_checkpointing_arguments_and_flags_are_config_errors():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError, match="unknown apply_checkpointing arguments"):
        estimate(model, (2, 32), device="cpu", checkpointing={"evry": 2})
    with pytest.raises(ConfigError) as info:
        estimate(model, (2, 32), device="gpu", checkpointing=0, setup={"offload_activations": "yes"})
    assert len(info.value.problems) == 3, info.value.problems


@pytest.mark.parametrize("batch, bad", [
    ((-1, 8), ["dimension 0 is -1"]),
    ((0, 8), ["dimension 0 is 0"]),
    ((2, 0), ["dimension 1 is 0"]),
    ((True, 8), ["dimension 0 is True"]),
    ((2.0, 8), ["dimension 0 is 2.0"]),
    ((2, 8.5), ["dimension 1 is 8.5"]),
    ((-2, 0.5), ["dimension 0 is -2", "dimension 1 is 0.5"]),
    ({"input_ids": (2, -8), "labels": (0, 8)}, ["batch['input_ids'] of shape (2, -8): dimension 1 is -8",
                                               "batch['labels'] of shape (0, 8): dimension 0 is 0"]),
    (torch.zeros(0, 8, dtype=torch.long), ["dimension 0 is 0"]),
])
def test_every_dimension_of_the_batch_must_be_an_integer_of_at_least_one(batch, bad):
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as info:
        estimate(model, batch, device="cpu")
    message = str(info.value)
    for fragment in bad:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert "To resolve this error" in message and message.count("To resolve this error") == len(info.value.problems)


def test_bad_micro_batch_size_and_seq_len_are_both_reported():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as info:
        estimate(model, micro_batch_size=0, seq_len=True, device="cpu")
    message = str(info.value)
    assert "micro_batch_size=0" in message and "seq_len=True" in message, message


# -- setup=: one Choices for the set-up -------------------------------------------------------------------------
def test_setup_is_traces_keyword_arguments_with_none_as_off():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    lean = Choices(checkpointing="every:2", chunked_loss=True,
                   optimizer=OptimizerChoice(state_precision="bf16", step_in_backward=True))
    got = estimate(model, (2, 32), device="cpu", setup=lean)
    want = trace(model, (2, 32), device="cpu", checkpointing="every:2", chunked_loss=True, state_precision="bf16",
                 step_in_backward=True).report
    assert got == want
    assert estimate(model, (2, 32), device="cpu", setup=Choices()) == estimate(model, (2, 32), device="cpu")
    offloaded = estimate(model, (2, 32), device="cpu", setup=Choices(optimizer=OptimizerChoice(placement="offload")))
    assert offloaded == estimate(model, (2, 32), device="cpu", optimizer="adamw-offload")
    # Lean moments are the offloaded AdamW's too: the optimizer named as 'adamw-offload' takes them (it was refused)
    bf16 = Choices(optimizer=OptimizerChoice(state_precision="bf16"))
    assert estimate(model, (2, 32), device="cpu", optimizer="adamw-offload", setup=bf16) == estimate(
        model, (2, 32), device="cpu", setup=Choices(optimizer=OptimizerChoice(placement="offload",
                                                                               state_precision="bf16")))
    same = estimate(model, (2, 32), device="cpu", checkpointing="all", setup=Choices(checkpointing="all"))
    assert same == estimate(model, (2, 32), device="cpu", checkpointing="all")


@pytest.mark.parametrize("kwargs, message", [
    (dict(checkpointing="every:2", setup=Choices(checkpointing="all")),
     "checkpointing='every:2' and setup.checkpointing='all' are two different policies"),
    (dict(checkpointing={"every": 2}, setup=Choices(checkpointing="every:2")), "two different policies"),
    (dict(optimizer="sgd", setup=Choices(optimizer=OptimizerChoice(placement="offload"))),
     "placement='offload' with optimizer='sgd'.*pass optimizer='adamw'"),
    (dict(optimizer="adafactor", setup=Choices(optimizer=OptimizerChoice(state_precision="int8"))),
     "options of AdamW.*not of optimizer='adafactor'"),
    (dict(optimizer="adamw-offload", setup=Choices(optimizer=OptimizerChoice(step_in_backward=True))),
     "step_in_backward=True with optimizer='adamw-offload'"),
    (dict(optimizer="adamw-offload", setup=Choices(optimizer=OptimizerChoice(placement="device"))),
     "placement='device' with optimizer='adamw-offload'"),
    (dict(setup={"chunked_loss": True}), r"not a memtrain.choices.Choices.*Choices.from_dict"),
])
def test_a_setup_that_contradicts_the_arguments_is_one_config_error_naming_the_fix(kwargs, message):
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError, match=message) as info:
        estimate(model, (2, 32), device="cpu", **kwargs)
    assert len(info.value.problems) == 1 and "To resolve this error" in str(info.value), info.value.problems
    with pytest.raises(ConfigError) as info:  # with the other arguments' problems, at once
        estimate(model, (2, 32), device="tpu", accumulation=0, **kwargs)
    assert len(info.value.problems) == 3, info.value.problems


def test_a_compiled_setup_is_estimated_eager_and_the_report_says_so():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    eager = estimate(model, (2, 32), device="cpu")
    compiled = estimate(model, (2, 32), device="cpu", setup=Choices(compile=True))
    assert compiled.peak_bytes == eager.peak_bytes
    assert compiled.assumptions == (*eager.assumptions, COMPILE_NOTE)
    assert "eager step" in COMPILE_NOTE and COMPILE_NOTE not in eager.assumptions
