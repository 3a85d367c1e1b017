"""Compile: ``torch.compile`` the step (fused kernels; the first steps compile). Its setting is
``Choices.compile`` (True: train compiles, plan also considers compiled set-ups); its flag is each command's own,
and parameter offload's rule with it is parameter offload's.
"""

from __future__ import annotations

from typing import Any

from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule

FIELDS = ("compile",)  # the Choices fields this technique owns
RULES: tuple[Rule, ...] = ()
SEARCH: tuple[str, ...] = ()  # compiled set-ups are searched where the run compiles (plan(compile=True))


def fixed(choices: Any, *, device: str, n_blocks: int) -> Fixing:
    """Compiled where asked; otherwise the plan's (it weighs compiled set-ups only when the run compiles)."""
    return Fixing({"compile": True if choices.compile else None})


def left_open(fixed: Any) -> list[str]:
    """Nothing to fix where the plan cannot choose: where no plan runs, the step is compiled only where asked."""
    return []
