"""A run on disk and what defines it.

- ``folder``: the run folder (ownership marker, lock, overwrite, the run's config.json).
- ``checkpoints``: checksummed checkpoints that fall back when damaged; write faults naming the intact one.
- ``identity``: fingerprints of the data and model, and which changed settings a resume refuses or applies.
- ``state``: everything a bit-identical resume needs, saved and restored; the model's weights file.
- ``metrics``: the append-only metrics log.
- ``tensorboard``: TensorBoard event files of the same lines (``log=("tensorboard",)``), an optional extra.
- ``signals``: stopping on SIGTERM / SIGINT: after the current step (agreed on by every rank), or within seconds
  inside a long step.
- ``replan``: the run's plan from its choices, its check against the device at step 2, the re-plan when they differ.
- ``plan_check``: the step-2 check's verdict on every device (the CPU's peak from the measured saved bytes): re-plan
  or warn when the step is over the budget.
- ``report``: the run's report (report.json) and its plots.
"""

from memtrain.run.checkpoints import SUMS, CheckpointDamaged, RunCheckpoints, RunWriteError, write_faults
from memtrain.run.folder import LOCK, MARKER, RUN_FILES, RUN_OUTPUTS, RunFolder, read_run_config
from memtrain.run.identity import (
    RESUME_POLICY,
    applied_changes,
    compare_runs,
    data_fingerprint,
    model_fingerprint,
)
from memtrain.run.metrics import MetricsLog
from memtrain.run.signals import StopNow, StopSignals, agree_on_stop
from memtrain.run.state import (
    model_state_dict,
    restore_run_state,
    resume_run,
    save_run_state,
    save_weights_file,
    tied_duplicates,
)

__all__ = [
    "LOCK",
    "MARKER",
    "RESUME_POLICY",
    "RUN_FILES",
    "RUN_OUTPUTS",
    "SUMS",
    "CheckpointDamaged",
    "MetricsLog",
    "RunCheckpoints",
    "RunFolder",
    "RunWriteError",
    "StopNow",
    "StopSignals",
    "agree_on_stop",
    "applied_changes",
    "compare_runs",
    "data_fingerprint",
    "model_fingerprint",
    "model_state_dict",
    "read_run_config",
    "restore_run_state",
    "resume_run",
    "save_run_state",
    "save_weights_file",
    "tied_duplicates",
    "write_faults",
]
