"""memtrain.run.replan: the plan of a run under its typed RunContext, and the plan after out of memory. The
re-plans inside a run (the shortfall folded in, the data order kept) are tests/test_train.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memtrain import MemtrainError, TrainConfig
from memtrain.run.replan import RunContext, check_plan, plan_after_out_of_memory, plan_run, replan_record


def _context(world: int = 1) -> RunContext:
    return RunContext(seq_len=4, global_batch=8, device=torch.device("cpu"), world=world, precision="fp32")


def test_a_model_without_blocks_halves_its_micro_batch_after_out_of_memory():
    model, config = nn.Linear(8, 8), TrainConfig()
    run_plan = plan_run(model, config, _context())
    assert run_plan.plan is None and run_plan.settings.micro_batch_size == 8 and run_plan.settings.accumulation == 1
    new = plan_after_out_of_memory(run_plan, "CUDA out of memory (injected)", model, config, _context(), step=0,
                                   measured_peak=None)
    assert new.settings.micro_batch_size == 4 and new.settings.accumulation == 2
    assert "micro-batch halved to 4" in new.reasons
    record = replan_record(0, "out of memory", run_plan, new)
    assert record["step"] == 1 and record["estimated_peak_before"] is None
    check = check_plan(new, 2, None, 100, torch.device("cpu"))
    assert check["over_budget"] is False and check["what"] is None


def test_out_of_memory_on_one_of_several_ranks_is_an_error():
    model, config = nn.Linear(8, 8), TrainConfig()
    run_plan = plan_run(model, config, _context(world=2))
    with pytest.raises(MemtrainError, match="on one of several ranks"):
        plan_after_out_of_memory(run_plan, "CUDA out of memory", model, config, _context(world=2), step=0,
                                 measured_peak=None)
