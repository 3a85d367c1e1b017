"""Temporary: removed at merge."""

from memtrain.run.checkpoints import SUMS, RunCheckpoints, RunWriteError, write_faults
from memtrain.run.folder import LOCK, MARKER, RunFolder, read_run_config
from memtrain.run.identity import RESUME_POLICY, applied_changes, data_fingerprint, model_fingerprint
from memtrain.run.metrics import MetricsLog
from memtrain.run.signals import StopSignals, agree_on_stop
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
    "SUMS",
    "MetricsLog",
    "RunCheckpoints",
    "RunFolder",
    "RunWriteError",
    "StopSignals",
    "agree_on_stop",
    "applied_changes",
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
