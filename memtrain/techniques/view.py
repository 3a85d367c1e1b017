"""What the planner shows a technique of the plan it chose, so that the technique words its own reason line.

A reason says what was chosen and what the best alternative to that one decision costs: the planner has every
candidate it composed (one row each) and answers ``alternative(mask, what)`` ("the chunked loss would be 3.1%
slower", "... would peak at 9.2 GiB at least, over the usable 7.6 GiB"); a technique picks the rows that differ from
the chosen one in its own decision (``column``, ``same``) and says the rest in its words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class PlanView(Protocol):
    """The chosen plan and its candidates, as a technique's ``reasons`` reads them.

    settings: the chosen ``PlanSettings``; chosen: its candidate's index in the columns.
    device: "cuda" or "cpu"; world: the ranks; per_rank: examples per rank per step.
    chunkable: whether memtrain can chunk this model's loss; grad_clip: whether the run clips gradients.
    budget_text: the budget in words ("the usable 22.8 GiB", or "no budget").
    offload, recompute: each candidate's count of offloaded and of recomputed blocks.
    """

    settings: Any
    chosen: int
    device: str
    world: int
    per_rank: int
    chunkable: bool
    grad_clip: bool
    budget_text: str
    offload: np.ndarray
    recompute: np.ndarray

    def column(self, name: str) -> np.ndarray:
        """Each candidate's value of a settings field, e.g. "optimizer"."""
        ...

    def same(self, *names: str) -> np.ndarray:
        """The candidates that share the chosen plan's values of ``names``."""
        ...

    def alternative(self, mask: np.ndarray, what: str, lean: bool = False) -> str:
        """What the best of the ``mask`` candidates costs against the chosen one, in words beginning with ``what``;
        "" where no such candidate was composed (``lean``: lean moments, whose margin the search asks for)."""
        ...


@dataclass(kw_only=True)
class SearchSpace:
    """The values the search goes over before the micro-batch; each technique fills in and narrows its own (the
    defaults: what a technique that has no say leaves, e.g. one process, eager).

    flavors: how recomputed blocks recompute ("full", "selective", "offload-inputs"; none: no recompute).
    offload_blocks: whether a block may keep every activation in host memory.
    placements, states: the optimizer's placements and AdamW's moment precisions.
    distributions: "none" (one process), "ddp", "fsdp2".
    in_backward: the optimizer stepping after backward (False) or in it (True); fractions: a device optimizer's
        shares of state in host RAM (0.0: none).
    losses: the loss whole (False) or chunked (True); weights: parameter offload off (False) or on (True).
    tiled: the blocks' MLPs whole (False) or over tiles of tokens (True).
    compiled: eager (False) or compiled (True).
    pure_bf16: only pure bf16 set-ups (fixed).
    """

    flavors: list[str] = field(default_factory=list)
    offload_blocks: bool = False
    placements: list[str] = field(default_factory=lambda: ["device"])
    states: list[str] = field(default_factory=lambda: ["fp32"])
    distributions: list[str] = field(default_factory=lambda: ["none"])
    losses: list[bool] = field(default_factory=lambda: [False])
    tiled: list[bool] = field(default_factory=lambda: [False])
    weights: list[bool] = field(default_factory=lambda: [False])
    in_backward: list[bool] = field(default_factory=lambda: [False])
    fractions: list[float] = field(default_factory=lambda: [0.0])
    compiled: list[bool] = field(default_factory=lambda: [False])
    pure_bf16: bool = False


class SearchProblem(Protocol):
    """What the search's candidates depend on: the device ("cuda": streams and a link to the host), the compute
    precision, the ranks (``fsdp``: True FSDP2, False DDP, None both), whether the loss can be chunked, whether every
    block's weights train, whether bitsandbytes' int8 moments run here, and whether the run compiles (compiled
    set-ups are weighed too); and how many tiles of a tiled MLP a sequence spans (0: the model has none)."""

    cuda: bool
    precision: str
    world: int
    fsdp: bool | None
    chunkable: bool
    blocks_all_train: bool
    int8: bool
    compile: bool
    mlp_tiles: int


class SearchRun(Protocol):
    """One pass of the search over a space: the micro-batch sizes it tries and the examples each rank takes per
    step."""

    micros: Sequence[int]
    per_rank: int
