"""Data parallelism over several ranks: DDP (every rank holds the whole model, gradients all-reduced) or FSDP2
(parameters, gradients and the optimizer state sharded, blocks gathered as they run). ``TrainConfig.fsdp`` (and
``plan(fsdp=)``) chooses it, or the plan compares the two; it has no ``Choices`` field, and its rules with the other
techniques are theirs (the optimizer's, pure bf16's, parameter offload's).
"""

from __future__ import annotations

from typing import Any

from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule
from memtrain.techniques.view import PlanView

FIELDS: tuple[str, ...] = ()
RULES: tuple[Rule, ...] = ()
SEARCH: tuple[str, ...] = ()  # DDP or FSDP2 is the plan's argument (fsdp=None compares them)


def fixed(choices: Any, *, device: str, n_blocks: int) -> Fixing:
    """Nothing in ``Choices``: the distribution is the run's (``fsdp``)."""
    return Fixing({})


def left_open(fixed: Any) -> list[str]:
    """Nothing here: where no plan runs, the run's ``fsdp`` decides."""
    return []


def reasons(view: PlanView) -> list[str]:
    """DDP or FSDP2 against the other, over several ranks; nothing for one."""
    if view.world <= 1:
        return []
    s = view.settings
    other = view.alternative(~view.same("distribution"), "FSDP2" if s.distribution == "ddp" else "DDP")
    return [f"{'DDP' if s.distribution == 'ddp' else 'FSDP2'} over {view.world} ranks"
            + (f", because: {other}" if other else " (as asked)")]
