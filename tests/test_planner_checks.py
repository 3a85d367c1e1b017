"""Tests of memtrain.planner: the checks: bad arguments, budgets and fixed choices are one clear error."""

from __future__ import annotations

import pytest
from helpers import fixed_cpu_profile, h100, planner_gpt

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.planner import (
    plan,
)

transformers = pytest.importorskip("transformers")

H100 = h100()
CPU = fixed_cpu_profile()





# The rules between the choices themselves are Choices' (they fail at its construction, or in check_run for the
# ranks): the planner's own message is left for what only a search finds (FSDP2 shards fp32 moments only).
@pytest.mark.parametrize("kwargs, optimizer, match", [
    ({}, dict(placement="device", step_in_backward=True, offload_fraction=0.5),
     "a partial offload steps after backward"),
    ({"world_size": 2}, dict(placement="device", step_in_backward=True),
     "optimizer.step_in_backward=True with world_size=2: DDP and FSDP2 reduce gradients"),
    ({"world_size": 2, "fsdp": True}, dict(placement="device", state_precision="int8"), "no set-up can be built"),
    ({"world_size": 2, "fsdp": True}, dict(placement="offload-bf16-weights"),
     "placement='offload-bf16-weights' with fsdp=True: FSDP2 offloads"),
])
def test_fixed_optimizer_choices_that_cannot_go_together_are_one_clear_error(kwargs, optimizer, match):
    with pytest.raises(ConfigError, match=match) as info:  # was a raw ValueError, or a silent fp32 optimizer
        plan(planner_gpt(2), budget=2**30, seq_len=32, global_batch_size=8, device="cpu", precision="fp32",
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


def test_choices_compile_fixes_a_compiled_step_and_compile_only_widens_the_search():
    kwargs = dict(budget=None, seq_len=32, global_batch_size=4, device="cpu", precision="fp32", device_profile=CPU)
    assert plan(planner_gpt(2), choices=Choices(compile=True), **kwargs).settings.compile
    widened = plan(planner_gpt(2), compile=True, **kwargs)
    assert any(c.settings.compile for c in (widened, *widened.candidates)), widened.summary()
    eager = plan(planner_gpt(2), **kwargs)
    assert not any(c.settings.compile for c in (eager, *eager.candidates)), eager.summary()
    with pytest.raises(ConfigError, match="is not a Choices"):
        plan(planner_gpt(2), choices={"compile": True}, **kwargs)
