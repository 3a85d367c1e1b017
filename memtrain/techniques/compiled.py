"""Compile: ``torch.compile`` the step (fused kernels; the first steps compile). Its setting is
``Choices.compile`` (True: train compiles, plan also considers compiled set-ups); its flag is each command's own,
and parameter offload's rule with it is parameter offload's.
"""

from __future__ import annotations

from typing import Any

from memtrain.message import Message, arg
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace


class CompileTechnique(Technique):
    """torch.compile the step: where asked for (and then also weighed by the plan)."""

    name = "torch.compile"
    fields = ("compile",)
    search = ()  # compiled set-ups are searched where the run compiles (plan(compile=True))

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """Compiled where asked; otherwise the plan's (it weighs compiled set-ups only when the run compiles)."""
        return Fixing({"compile": True if choices.compile else None})

    def left_open(self, fixed: Any) -> list[str]:
        """Nothing to fix where the plan cannot choose: where no plan runs, the step is compiled only where asked."""
        return []

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """Eager, and compiled too where the run compiles."""
        space.compiled = [False, True] if problem.compile else [False]

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        if fixed.compile is not None:
            space.compiled = [fixed.compile]

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        return [{"compile": compiled} for compiled in space.compiled]

    def planned_setup(self, record: Any) -> dict[str, Any]:
        return {"compile": record.compile}

    def chosen(self, settings: Any) -> dict[str, Any]:
        return {"compile": settings.compile}

    def reasons(self, view: PlanView) -> list[str]:
        """torch.compile or eager against the other, where compiled set-ups were searched or chosen."""
        s = view.settings
        same = view.same("compile")
        if not s.compile and same.all():
            return []
        other = view.alternative(~same, "eager" if s.compile else "torch.compile")
        per_block = s.compile and ("offload" in s.blocks or (s.flavor == "offload-inputs" and "recompute" in s.blocks))
        return [("torch.compile" if s.compile else "eager")
                + (" block by block (the blocks offload activations: the offloader stays outside the compiled "
                   "regions, and the embeddings, last norm, head and loss run eager)" if per_block else "")
                + (f", because: {other}" if other else "")]

    def trainer_problems(self, choices: Any) -> list[str]:
        """The Trainer compiles the model itself (its own argument)."""
        if not choices.compile:
            return []
        return [Message(f"{arg('compile', True)}: the Trainer compiles the model itself. To resolve this error, drop "
                        "compile and pass TrainingArguments(torch_compile=True).")]


TECHNIQUE = CompileTechnique()
