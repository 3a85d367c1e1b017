"""Data parallelism over several ranks: DDP (every rank holds the whole model, gradients all-reduced) or FSDP2
(parameters, gradients and the optimizer state sharded, blocks gathered as they run). ``TrainConfig.fsdp`` (and
``plan(fsdp=)``) chooses it, or the plan compares the two; it has no ``Choices`` field, and its rules with the other
techniques are theirs (the optimizer's, pure bf16's, parameter offload's).
"""

from __future__ import annotations

from typing import Any

from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace


class DistributionTechnique(Technique):
    """DDP or FSDP2 over several ranks: the run's fsdp, or the plan's comparison."""

    name = "data parallelism"
    search = ()  # DDP or FSDP2 is the plan's argument (fsdp=None compares them)

    def reasons(self, view: PlanView) -> list[str]:
        """DDP or FSDP2 against the other, over several ranks; nothing for one."""
        if view.world <= 1:
            return []
        s = view.settings
        other = view.alternative(~view.same("distribution"), "FSDP2" if s.distribution == "ddp" else "DDP")
        return [f"{'DDP' if s.distribution == 'ddp' else 'FSDP2'} over {view.world} ranks"
                + (f", because: {other}" if other else " (as asked)")]

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """One process; over several ranks FSDP2 (fsdp=True), DDP (False), or both to compare (None)."""
        space.distributions = ["none"] if problem.world == 1 else (
            ["fsdp2"] if problem.fsdp else ["ddp"] if problem.fsdp is False else ["ddp", "fsdp2"])

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        return [{"distribution": distribution} for distribution in space.distributions]


TECHNIQUE = DistributionTechnique()
