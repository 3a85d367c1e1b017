"""Tiled MLP: each block's MLP over tiles of the hidden size's count of tokens (``memtrain.tiled_mlp``), so that its
intermediate never exists whole. Its setting is ``Choices.tiled_mlp``; its rules: a model with an MLP to tile, and
eager (its backward differentiates each tile itself, which torch.compile does not trace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any

from memtrain.message import arg
from memtrain.setting import flag
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace
from memtrain.tiled_mlp import MLP_NAMES, apply_tiled_mlp

FIELD = field(default=None, metadata=flag(
    "--tiled-mlp", "each block's MLP over tiles of tokens, never its whole intermediate ({unset})", kind="switch",
    off="the plan's: considered where sequences span 4 tiles or more"))

# The fewest tiles a sequence must span for the search to weigh tiling: below, the MLP's intermediate is no larger
# than the attention's and the loss's transients, and tiling costs a second copy of the MLP's weight gradients.
MIN_TILES = 4

TILED_MLP_MODEL = Rule(
    "tiled-mlp-model",
    "memtrain.tiled_mlp finds no MLP to tile in this model: it tiles the child of each repeated block named "
    f"{' / '.join(MLP_NAMES)} that maps each token alone (no experts, no router).",
    f"pass {arg('tiled_mlp', False)}",
    ("tiled_mlp", "tileable"),
    lambda s: bool(s.tiled_mlp) and s.tileable is False)

TILED_MLP_COMPILE = Rule(
    "tiled-mlp-compile",
    "a tiled MLP's backward differentiates each tile itself (torch.autograd.grad inside backward): torch.compile "
    "breaks its graph there, and the compiled step peaks higher than the untiled one.",
    "drop {rest}, or pass " + arg("tiled_mlp", False),
    ("tiled_mlp", "compile"),
    lambda s: bool(s.tiled_mlp and s.compile))


def kind_name(kind: str, tiled_mlp: bool) -> str:
    """The planner's profile of a block kind with its MLP whole or tiled: "full", "full+tiled"."""
    return f"{kind}+tiled" if tiled_mlp else kind


def profile_kind(kind: str, cfg: Any) -> str:
    """The profile the planner reads for blocks of ``kind`` in ``cfg`` (a ``Configuration``)."""
    return kind_name(kind, cfg.tiled_mlp)


class TiledMLPTechnique(Technique):
    """Each block's MLP over tiles of tokens: on, off, or the plan's."""

    name = "tiled MLP"
    fields = ("tiled_mlp",)
    rules = (TILED_MLP_MODEL, TILED_MLP_COMPILE)
    search = ("tiled-mlp",)

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """The tiled MLP as given (None: the plan's)."""
        return Fixing({"tiled_mlp": choices.tiled_mlp})

    def left_open(self, fixed: Any) -> list[str]:
        """Nothing to fix where the plan cannot choose: where no plan runs, the MLP is tiled only where asked."""
        return []

    def planned_setup(self, record: Any) -> dict[str, Any]:
        return {"tiled_mlp": record.tiled_mlp}

    def chosen(self, settings: Any) -> dict[str, Any]:
        return {"tiled_mlp": settings.tiled_mlp}

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """Both where the model has an MLP to tile and a sequence spans ``MIN_TILES`` tiles (a compiled set-up is
        never tiled: ``skips``)."""
        space.tiled = [False, True] if "tiled-mlp" in allowed and problem.mlp_tiles >= MIN_TILES else [False]

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        if fixed.tiled_mlp is not None:
            space.tiled = [fixed.tiled_mlp]

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        return [{"tiled_mlp": tiled} for tiled in space.tiled]

    def skips(self, configuration: Any, fixed: Any, run: SearchRun) -> bool:
        """A compiled set-up with a tiled MLP (the rule refuses it; the search never proposes it)."""
        return bool(configuration.tiled_mlp and configuration.compile)

    def reasons(self, view: PlanView) -> list[str]:
        """The MLP tiled or whole, against the other, where both were weighed or tiling was chosen."""
        tiled = view.settings.tiled_mlp
        same = view.same("tiled_mlp")
        if not tiled and same.all():
            return []
        other = view.alternative(~same, "the whole MLP" if tiled else "the tiled MLP")
        return [("MLP over tiles of the hidden size's count of tokens (tiled)" if tiled else "MLP whole")
                + (f", because: {other}" if other else "")]

    def setup_text(self, setup: Any) -> str:
        return "a tiled MLP" if setup.tiled_mlp else ""

    def planned_text(self, settings: Any) -> str:
        return "tiled MLP" if settings.tiled_mlp else ""

    def prepare_model(self, model: Any, choices: Any, *, chunk_tokens: int) -> dict[str, Any]:
        """Each block's MLP tiled where asked (the hidden size's count of tokens a tile)."""
        if not choices.tiled_mlp:
            return {}  # an MLP the user tiled by hand stays tiled
        count = apply_tiled_mlp(model)
        return {"reasons": [f"MLP: {count} blocks' MLPs over tiles of the hidden size's count of tokens, because: "
                            "Choices(tiled_mlp=True)"]}

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        return {"tiled_mlp": bool(setup.tiled_mlp)}, []

    def planned_options(self, settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
        return {"tiled_mlp": settings.tiled_mlp}


TECHNIQUE = TiledMLPTechnique()
