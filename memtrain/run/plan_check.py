"""The plan against the device at step 2, on every device: over the budget, the run re-plans (or, where it cannot,
says so in a warning).

On an accelerator (a simulated one too) the figure is the allocator's peak over the step. The CPU has no allocator peak to read, so the figure there
is the plan's predicted peak with the saved-for-backward bytes corrected to the measured ones (what ``measure``
counts, exactly the bytes a wrong estimate misses): a step that saves 10 MiB more than predicted peaks about 10 MiB
higher.
"""

from __future__ import annotations

import dataclasses

import torch

from memtrain.device import accelerator
from memtrain.report import format_bytes
from memtrain.run.replan import PlanInForce, check_plan
from memtrain.run.state import PlanCheck


def check_step(in_force: PlanInForce, step: int, peak_bytes: int | None, activation_bytes: int | None,
               device: torch.device, *, can_replan: bool) -> PlanCheck:
    """``check_plan``'s comparison of what the plan predicted with what step ``step`` (counted from 1) measured,
    with the step's peak against the budget on the CPU too.

    Args:
        peak_bytes: the accelerator allocator's peak over the step (None on the CPU).
        activation_bytes: the bytes saved for backward in the step's first micro-batch (None: not measured).
        can_replan: the run can re-plan now (one rank, steps left); otherwise a peak over the budget is a warning.

    Returns:
        ``check_plan``'s ``PlanCheck`` with ``over_budget``, ``replanning`` (the caller re-plans with the shortfall
        ``measured_bytes - predicted_bytes``) and ``peak_bytes`` (the measured or, on the CPU, corrected peak;
        None where there is nothing to compare) decided here.
    """
    # Without a budget check_plan only compares: the verdict and its words are this function's.
    check = check_plan(dataclasses.replace(in_force, budget_bytes=None), step, peak_bytes, activation_bytes, device)
    p, budget, measured = in_force.plan, in_force.budget_bytes, check.measured_bytes
    if p is None or measured is None:
        return check
    if accelerator(device).has_streams:
        peak, what = measured, "measured peak"
    else:  # the estimate's own peak (any correction taken out again), with the saved bytes it missed put back
        peak = p.peak_bytes - in_force.correction_bytes + measured - check.predicted_bytes
        what = "peak with the measured saved bytes"
    if budget is None or peak <= budget:
        return dataclasses.replace(check, peak_bytes=peak)
    over = f"{what} {format_bytes(peak)} is over the budget {format_bytes(budget)}"
    log = check.log + (f": the {over}, re-planning" if can_replan else
                       f". Warning: the {over}; the run goes on with this plan (a re-plan needs one process and a "
                       f"step left). To stay within it, run again with --budget "
                       f"{format_bytes(max(1, 2 * budget - peak))} (budget=): the budget less what the estimate "
                       "missed")
    return dataclasses.replace(check, peak_bytes=peak, over_budget=True, replanning=can_replan, log=log)
