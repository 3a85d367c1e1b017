"""Gradient accumulation: a rank's examples of one optimizer step as micro-batches, their gradients summed before
the step (``GradientAccumulator``: explicit windows, a token-count-correct loss, DDP/FSDP2 synchronised only at the
window's end). The plan chooses the micro-batch (``plan(micro_batch_size=)`` fixes it); it has no ``Choices`` field
and no rule with the other techniques (a step in backward over several micro-batches saves nothing, so the search
passes it over, and a fixed one steps in the last micro-batch's backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchRun, SearchSpace


class AccumulationTechnique(Technique):
    """The micro-batch and its accumulation: the plan's, or plan(micro_batch_size=)'s."""

    name = "gradient accumulation"
    search = ()  # the micro-batch is always the search's, unless plan(micro_batch_size=) fixes it

    def reasons(self, view: PlanView) -> list[str]:
        """The micro-batch and accumulation, against a smaller micro-batch (or another one)."""
        s = view.settings
        other = view.alternative(~view.same("micro_batch_size"), "a smaller micro-batch"
                                 if s.micro_batch_size == view.per_rank else "another micro-batch")
        return [f"micro-batch {s.micro_batch_size} x {s.accumulation} accumulation = {view.per_rank} examples per rank "
                "per step" + (f", because: {other}" if other else "")]

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        """Each micro-batch size the search tries, with the micro-batches per step that make the rank's examples."""
        return [{"micro_batch_size": b, "accumulation": run.per_rank // b} for b in run.micros]

    def planned_options(self, settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
        """The micro-batches per optimizer step, as planned."""
        return {"accumulation": settings.accumulation}


TECHNIQUE = AccumulationTechnique()
