"""Activation offload: the tensors saved for backward live in pinned host memory, copied out on a side stream and
prefetched before backward needs them (PCIe traffic instead of device bytes; CUDA only). Its setting is
``Choices.offload_activations`` (a checkpointing policy's "+offload" asks for it too); its rule with checkpointing
follows.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

import memtrain.offload
from memtrain.message import arg
from memtrain.setting import flag
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchSpace

FIELD = field(default=None, metadata=flag(
    "--offload-activations", "saved activations in pinned host memory, prefetched before backward (CUDA; "
    "{unset})", kind="switch"))

CHECKPOINT_OFFLOAD_INPUTS = Rule(
    "checkpoint-offload-inputs",
    f"the policy offloads the recomputed blocks' inputs, but {arg('offload_activations', False)} says not to.",
    f"drop +offload or {arg('offload_activations', False)}",
    ("checkpointing", "offload_activations"),
    lambda s: s.checkpointing is not None and s.checkpointing.offload_inputs and s.offload_activations is False,
    shows_false=("offload_activations",))

CHECKPOINT_OFFLOAD_BLOCKS = Rule(
    "checkpoint-offload-blocks",
    f"the layout's O blocks keep their activations in pinned host memory, but {arg('offload_activations', False)} "
    "says not to.",
    f"make those blocks K or R, or drop {arg('offload_activations', False)}",
    ("checkpointing", "offload_activations"),
    lambda s: s.checkpointing is not None and "offload" in s.checkpointing.blocks and s.offload_activations is False,
    shows_false=("offload_activations",))

CPU_NOTE = "activation offload has no effect on a CPU-only run (no device memory to save): off"


def asked(choices: Any) -> bool | None:
    """Whether a run's ``Choices`` send activations to the host: True where asked for directly or by a "+offload"
    policy, False where refused, None where the plan's."""
    if choices.checkpointing is not None and choices.checkpointing.offload_inputs:
        return True
    return choices.offload_activations


def offloads_layout(choices: Any, device: str) -> bool | None:
    """Whether what a fixed checkpointing layout keeps goes to the host too (``choices.offload_activations``; off
    where the run trains on a CPU, which has no device memory to save)."""
    if asked(choices) and device != "cuda":
        return False
    return choices.offload_activations


class ActivationOffloadTechnique(Technique):
    """Saved activations in pinned host memory: refused, asked for, or the plan's."""

    name = "activation offload"
    fields = ("offload_activations",)
    rules = (CHECKPOINT_OFFLOAD_INPUTS, CHECKPOINT_OFFLOAD_BLOCKS)
    search = ("offload-activations",)  # the plan offloads the blocks' saved activations, or their inputs

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """Activation offload's share of a plan's fixed choices (``choices``: a ``Choices``): refused (False), the
        search never offloads; on a CPU, off with a note. What it does to a fixed layout is checkpointing's share."""
        note = (CPU_NOTE,) if asked(choices) and device != "cuda" else ()
        return Fixing({}, {"offload-activations"} if offloads_layout(choices, device) is False else set(), note)

    def left_open(self, fixed: Any) -> list[str]:
        """Nothing to fix where the plan cannot choose: where no plan runs, activations stay on the device unless
        asked for."""
        return []

    def chosen(self, settings: Any) -> dict[str, Any]:
        """Refused where the set-up offloads nothing; otherwise the layout's (its "O" blocks, its "+offload")."""
        offloads = "offload" in settings.blocks or (
            settings.flavor == "offload-inputs" and "recompute" in settings.blocks)
        return {"offload_activations": None if offloads else False}

    def setup_text(self, setup: Any) -> str:
        return "activations offloaded to host RAM" if setup.offload_activations else ""

    def reasons(self, view: PlanView) -> list[str]:
        """No line of its own: its words are checkpointing's (which blocks offload, which inputs go to the host)."""
        return []

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """A block may keep every activation in pinned host memory (CUDA only: a CPU has no device memory to save).
        The recomputed blocks' offloaded inputs are checkpointing's flavor."""
        space.offload_blocks = problem.cuda and "offload-activations" in allowed

    def trainer_step(self, model: Any, choices: Any) -> Any:
        """Each training step's forward and backward inside ``offload_activations(model=...)``."""
        return memtrain.offload.offload_activations(model=model) if choices.offload_activations else None

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        """Every saved activation offloaded where asked for (a "+offload" policy is checkpointing's to trace)."""
        return {"offload_activations": bool(setup.offload_activations)}, []


TECHNIQUE = ActivationOffloadTechnique()
