"""memtrain.run.replan: the plan of a run under its typed RunContext, and the plan after out of memory. The
re-plans inside a run (the shortfall folded in, the data order kept) are tests/test_train.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from memtrain import ConfigError, MemtrainError, TrainConfig
from memtrain.choices import Choices, OptimizerChoice
from memtrain.run.replan import (
    PLAN_FIELDS,
    RunContext,
    check_kept_optimizer,
    check_plan,
    flat_settings,
    plan_after_out_of_memory,
    plan_for_run,
    plan_request,
    read_plan_request,
    replan_record,
)


def _context(world: int = 1) -> RunContext:
    return RunContext(seq_len=4, global_batch=8, device=torch.device("cpu"), world=world, precision="fp32")


def test_a_model_without_blocks_halves_its_micro_batch_after_out_of_memory():
    model, config = nn.Linear(8, 8), TrainConfig()
    in_force = plan_for_run(model, config, _context())
    assert in_force.plan is None and in_force.settings.micro_batch_size == 8 and in_force.settings.accumulation == 1
    new = plan_after_out_of_memory(in_force, "CUDA out of memory (injected)", model, config, _context(), step=0,
                                   measured_peak=None)
    assert new.settings.micro_batch_size == 4 and new.settings.accumulation == 2
    assert "micro-batch halved to 4" in new.reasons
    record = replan_record(0, "out of memory", in_force, new)
    assert record["step"] == 1 and record["estimated_peak_before"] is None
    check = check_plan(new, 2, None, 100, torch.device("cpu"))
    assert check.over_budget is False and check.what is None
    assert "step" not in check.to_dict()  # the JSON of a run without a plan, as it always was


def test_out_of_memory_on_one_of_several_ranks_is_an_error():
    model, config = nn.Linear(8, 8), TrainConfig()
    in_force = plan_for_run(model, config, _context(world=2))
    with pytest.raises(MemtrainError, match="on one of several ranks"):
        plan_after_out_of_memory(in_force, "CUDA out of memory", model, config, _context(world=2), step=0,
                                 measured_peak=None)


# -- the plan request a checkpoint keeps (issue 19: choices in one field) ----------------------------------
def test_a_saved_plan_request_reads_back_as_written():
    config = TrainConfig(micro_batch_size=2, choices=Choices(
        checkpointing="every:2", optimizer=OptimizerChoice(placement="device", state_precision="fp32")))
    assert set(plan_request(config)) == {*PLAN_FIELDS} and read_plan_request(plan_request(config)) == plan_request(config)
    assert read_plan_request(plan_request(config)) != plan_request(TrainConfig(micro_batch_size=2))
    assert read_plan_request(None) is None


def test_a_saved_config_shows_its_choices_by_name():
    saved = TrainConfig(max_steps=2, choices=Choices(checkpointing="none")).to_dict()
    assert flat_settings(saved)["checkpointing"] == "none" and flat_settings(saved)["compile"] is False
    assert flat_settings(saved)["max_steps"] == 2 and "choices" not in flat_settings(saved)
    # A policy left to the plan reads as the flag's own word.
    assert flat_settings(TrainConfig().to_dict())["checkpointing"] == "auto"


def test_the_world_size_rule_is_checked_where_the_world_is_known():
    config = TrainConfig(choices=Choices(optimizer=OptimizerChoice(step_in_backward=True)))
    plan_for_run(nn.Linear(8, 8), config, _context())
    with pytest.raises(ConfigError, match="optimizer.step_in_backward=True with world_size=2"):
        plan_for_run(nn.Linear(8, 8), config, _context(world=2))


def test_a_kept_optimizer_admits_only_itself():
    kept = plan_for_run(nn.Linear(8, 8), TrainConfig(), _context()).settings
    check_kept_optimizer(Choices(), kept)
    check_kept_optimizer(Choices(optimizer=OptimizerChoice(placement="device", state_precision="fp32")), kept)
    with pytest.raises(ConfigError, match=r"optimizer.placement='device', optimizer.state_precision='bf16': the "
                                          r"run's optimizer is"):
        check_kept_optimizer(Choices(optimizer=OptimizerChoice(placement="device", state_precision="bf16")),
                             replace(kept, optimizer="offload"))
    # Bf16 device weights (the host master's casts) are a placement of their own: each takes only its own run. The
    # plan keeps the run's (keep_optimizer), so "offload" over a bf16-weights run would have been ignored.
    bf16_weights = replace(kept, optimizer="offload-bf16-weights")
    with pytest.raises(ConfigError, match=r"optimizer.placement='offload': the run's optimizer is"):
        check_kept_optimizer(Choices(optimizer=OptimizerChoice(placement="offload")), bf16_weights)
    check_kept_optimizer(Choices(optimizer=OptimizerChoice(placement="offload-bf16-weights")), bf16_weights)
    with pytest.raises(ConfigError, match=r"optimizer.placement='offload-bf16-weights': the run's optimizer is"):
        check_kept_optimizer(Choices(optimizer=OptimizerChoice(placement="offload-bf16-weights")),
                             replace(kept, optimizer="offload"))


def test_a_resume_that_asks_for_another_weight_layout_is_refused_not_ignored():
    # The plan keeps the run's pure bf16 and streamed weights (the optimizer's state exists already): asking for
    # another on a resume was silently ignored.
    kept = replace(plan_for_run(nn.Linear(8, 8), TrainConfig(), _context()).settings, optimizer="offload")
    with pytest.raises(ConfigError, match=r"pure_bf16=True: the run's optimizer is offload.*drop pure_bf16="):
        check_kept_optimizer(Choices(pure_bf16=True), kept)
    with pytest.raises(ConfigError, match=r"offload_weights=True: .*drop offload_weights="):
        check_kept_optimizer(Choices(offload_weights=True), kept)
    with pytest.raises(ConfigError, match=r"offload_weights=False"):
        check_kept_optimizer(Choices(offload_weights=False), replace(kept, offload_weights=True))
    check_kept_optimizer(Choices(), replace(kept, offload_weights=True, pure_bf16=True))  # unset: the run's own


# -- a model the estimate cannot trace (issue 21) -----------------------------------------------------------
class _Routed(nn.Module):
    """A block whose shapes follow a value computed from its weights, as an MoE router's token counts do."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        kept = int((self.proj.weight > 0).sum().item()) % 3 + 1  # a count only the data knows
        return self.proj(x)[..., :kept].sum(-1, keepdim=True).expand_as(x)


class _RoutedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([_Routed(), _Routed()])

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return h.mean()


_EVERY_TECHNIQUE = Choices(checkpointing="all", chunked_loss=False,
                           optimizer=OptimizerChoice(placement="device", state_precision="fp32", step_in_backward=False))


def test_every_technique_fixed_runs_without_the_estimate():
    config = TrainConfig(budget="1GiB", micro_batch_size=4, choices=_EVERY_TECHNIQUE)
    in_force = plan_for_run(_RoutedStack(), config, _context())
    assert in_force.plan is None
    s = in_force.settings
    assert (s.micro_batch_size, s.accumulation, s.blocks, s.chunked_loss, s.optimizer, s.state_precision) == (
        4, 2, ("recompute", "recompute"), False, "device", "fp32"), s
    assert any("plan check off, because: the estimate cannot trace _RoutedStack" in r and "reads a tensor value" in r
               for r in in_force.reasons), in_force.reasons
    check = check_plan(in_force, 2, None, 1234, torch.device("cpu"))
    assert check.log.startswith("plan check off: the estimate cannot trace _RoutedStack"), check
    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide the 8 examples"):  # checked before
        plan_for_run(_RoutedStack(), replace(config, micro_batch_size=3), _context())
    # A resume continues on its own settings, unchecked too.
    resumed = plan_for_run(_RoutedStack(), config, _context(), settings=s, keep_optimizer=s)
    assert resumed.settings == s and resumed.plan is None


def test_techniques_left_to_the_planner_are_named_with_the_cause():
    config = TrainConfig(budget="1GiB", choices=Choices(checkpointing="all"))
    with pytest.raises(MemtrainError) as caught:
        plan_for_run(_RoutedStack(), config, _context())
    message = str(caught.value)
    assert not isinstance(caught.value, ConfigError)
    assert message.startswith("the planner cannot estimate _RoutedStack: 'blocks.0' reads a tensor value"), message
    for fix in ("chunked_loss=False", "optimizer.placement='device'", "optimizer.state_precision='fp32'",
                "optimizer.step_in_backward=False", "micro_batch_size=8"):
        assert fix in message, (fix, message)
    assert "checkpointing=" not in message and "batch's shape" not in message and "\n" not in message, message
