"""plan(): one byte budget in, the fastest training set-up that fits out, with a reason for every choice.

- ``devices``: the device's rates (``DeviceProfile``), known GPUs, calibration (``calibrate``, ``device_profile``).
- ``settings``: ``PlanSettings``, ``Fixed``, ``HostLink``, ``Candidate``, ``Plan``; the ``Problem`` and a ``Configuration``.
- ``profiles``: per-block profiles cut from traced steps (bytes saved, peaks, work), affine in the micro-batch.
- ``tracing``: the step traced per block kind at two micro-batches; the model state's bytes.
- ``cost``: the cost model: peaks, host bytes and step time composed from the profiles (``Composer``).
- ``checks``: budgets, fixed choices and hand-made set-ups checked, each problem with its fix.
- ``reasons``: the reasons, the runners-up, the assumptions and the "nothing fits" error.
- ``search``: ``plan`` and ``predictions``: the candidates searched, the fastest that fits confirmed by an estimate.
- ``apply``: ``apply_plan`` and ``configure_model``, the only part that imports the techniques.
"""

from memtrain.planner.apply import AppliedPlan, apply_plan, configure_model
from memtrain.planner.checks import budget_bytes
from memtrain.planner.cost import fsdp2_param_dtype
from memtrain.planner.devices import DeviceProfile, calibrate, device_profile, known_gpu, planning_device
from memtrain.planner.search import plan, predictions
from memtrain.planner.settings import (
    TECHNIQUES,
    Candidate,
    Fixed,
    HostLink,
    Plan,
    PlanSettings,
)

__all__ = ["TECHNIQUES", "Candidate", "DeviceProfile", "Fixed", "HostLink", "Plan", "PlanSettings", "AppliedPlan",
           "apply_plan", "budget_bytes", "calibrate", "configure_model", "device_profile", "fsdp2_param_dtype",
           "known_gpu", "plan", "planning_device", "predictions"]
