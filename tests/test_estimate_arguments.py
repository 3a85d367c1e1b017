"""estimate's arguments: every problem reported at once, each naming the fix."""

from __future__ import annotations

import pytest
import torch

from memtrain.errors import ConfigError
from memtrain.estimate import estimate
from memtrain.models import GPT, GPT_PRESETS


def test_bad_arguments_are_all_reported_at_once():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as info:
        estimate(model, (2, 16), device="tpu", precision="bf16", optimizer="lion", checkpointing="sometimes")
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert all("To resolve this error" in p for p in problems)
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
        estimate(model, (2, 32), device="gpu", checkpointing=0, offload_activations="yes")
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
