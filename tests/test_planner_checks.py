"""Tests of memtrain.planner: the checks: bad arguments, budgets and fixed choices are one clear error."""

from __future__ import annotations

import pytest
from helpers import tiny_gpt, tiny_llama_config

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.models import GPT
from memtrain.planner import (
    DeviceProfile,
    known_gpu,
    plan,
)

transformers = pytest.importorskip("transformers")

H100 = known_gpu("NVIDIA H100 80GB HBM3")
# Fixed CPU figures: the tests do not depend on how fast (or how loaded) the machine running them is.
CPU = DeviceProfile(name="test cpu", matmul_flops=50e9, half_efficiency_tokens=256, attention_flops=10e9,
                    memory_bandwidth=10e9, op_overhead_s=5e-6, host_to_device=5e9, device_to_host=5e9,
                    cpu_adamw=5e8, host_bandwidth=10e9, interconnect=5e9, memory_bytes=None, source="test",
                    asynchronous=False)


def _llama(layers: int = 4, hidden: int = 512, **overrides):
    return tiny_llama_config(**{**dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                       num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                                       max_position_embeddings=2048, use_cache=False), **overrides})


def _gpt(layers: int = 4) -> GPT:
    return tiny_gpt(layers, n_head=4, n_embd=128, seq_len=128, vocab_size=256, dropout=0.0, seed=0)


@pytest.fixture(scope="module")
def llama():
    return _llama()


# The rules between the choices themselves are Choices' (they fail at its construction, or in check_run for the
# ranks): the planner's own message is left for what only a search finds (FSDP2 shards fp32 moments only).
@pytest.mark.parametrize("kwargs, optimizer, match", [
    ({}, dict(placement="device", step_in_backward=True, offload_fraction=0.5),
     "a partial offload steps after backward"),
    ({"world_size": 2}, dict(placement="device", step_in_backward=True),
     "step_in_backward and offload_fraction act on gradients before DDP"),
    ({"world_size": 2, "fsdp": True}, dict(placement="device", state_precision="int8"), "no set-up can be built"),
    ({}, dict(placement="offload", state_precision="int8"), "placement='offload' with state_precision='int8'"),
])
def test_fixed_optimizer_choices_that_cannot_go_together_are_one_clear_error(kwargs, optimizer, match):
    with pytest.raises(ConfigError, match=match) as info:  # was a raw ValueError, or a silent fp32 optimizer
        plan(_gpt(2), budget=2**30, seq_len=32, global_batch_size=8, device="cpu", precision="fp32",
             choices=Choices(optimizer=OptimizerChoice(**optimizer)), device_profile=CPU, **kwargs)
    assert "To resolve this error" in str(info.value)


# -- input and output ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget, match", [(-1, "positive"), (0, "positive"), ("lots", "not a size"),
                                           ("1KiB", "smaller than one block")])
def test_bad_budgets_are_one_clear_error(llama, budget, match):
    with pytest.raises(ConfigError, match=match) as info:
        plan(llama, budget=budget, seq_len=1024, global_batch_size=4, device_profile=H100)
    assert "To resolve this error" in str(info.value)


def test_bad_arguments_are_reported_together(llama):
    with pytest.raises(ConfigError) as info:
        plan(llama, budget="1GiB", seq_len=0, global_batch_size=4, device="tpu", precision="fp8",
             techniques=["magic"], device_profile=H100)
    assert len(info.value.problems) == 4, info.value.problems
    with pytest.raises(ConfigError, match="does not divide"):
        plan(llama, budget="1GiB", seq_len=1024, global_batch_size=6, micro_batch_size=4, device_profile=H100)
