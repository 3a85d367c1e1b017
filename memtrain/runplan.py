"""Temporary: removed at merge."""
# memtrain.runplan moved to memtrain.run.replan (re-planning) and memtrain.run.report (the run report).

from memtrain.run.replan import (  # noqa: F401
    OOM_MIN_OVERSHOOT,
    PLAN_FIELDS,
    RunContext,
    RunPlan,
    check_plan,
    failed_allocation_bytes,
    plan_request,
    plan_run,
    replan,
    run_budget,
    shortfall_after_oom,
)
from memtrain.run.report import write_run_report  # noqa: F401
