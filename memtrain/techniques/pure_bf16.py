"""Pure bf16: bf16 weights with no fp32 master, each update rounded stochastically (``PureBF16AdamW``): 2 bytes per
parameter of weights and 2 of gradient, no master on the device or the host. It changes the numerics, so the plan
never picks it; its setting is the one switch ``Choices.pure_bf16``, and its rules with the other techniques.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any

from memtrain.message import Message, arg
from memtrain.setting import flag
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule, SetUp
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchRun, SearchSpace

FIELD = field(default=False, metadata=flag(
    "--pure-bf16", "bf16 weights with no fp32 master, each update rounded stochastically: 2 bytes per parameter "
    "of weights and 2 of gradient, no master on the device or in host RAM; moments fp32 or bf16 "
    "(--optimizer-state). Changes the numerics: never chosen by the plan (default: off; bf16-mixed precision)",
    kind="on"))

PURE_BF16_INT8 = Rule(
    "pure-bf16-int8",
    "bitsandbytes' 8-bit AdamW rounds a bf16 weight's update to nearest, losing updates below half an ulp (pure "
    "bf16 needs stochastic rounding).",
    f"pass {arg('state_precision', 'bf16')} or 'fp32', or drop {arg('pure_bf16')}",
    ("pure_bf16", "state_precision"),
    lambda s: bool(s.pure_bf16) and s.state_precision == "int8")
PURE_BF16_PRECISION = Rule(
    "pure-bf16-precision",
    "pure bf16 keeps bf16 weights and computes in bf16 (no fp32 master, no fp16 loss scaling).",
    f"pass {arg('precision', 'bf16-mixed')}, or drop {arg('pure_bf16')}",
    ("pure_bf16", "precision"),
    lambda s: bool(s.pure_bf16) and s.precision in ("fp32", "fp16-mixed"))
PURE_BF16_FSDP = Rule(
    "pure-bf16-fsdp",
    "PureBF16AdamW slices whole bf16 parameters, not FSDP2's sharded ones.",
    f"drop {arg('fsdp', True)} (DDP or one process), or drop {arg('pure_bf16')}",
    ("pure_bf16", "fsdp"),
    lambda s: bool(s.pure_bf16) and bool(s.fsdp))

PURE_BF16_CAST_WEIGHTS = Rule(
    "pure-bf16-cast-weights",
    "pure bf16 has no fp32 master to cast the device's weights from: its weights are bf16 already.",
    f"pass {arg('optimizer.placement', 'offload')} (pure bf16's weights and state in host RAM), or drop "
    f"{arg('pure_bf16')}",
    ("pure_bf16", "placement"),
    lambda s: bool(s.pure_bf16) and s.placement == "offload-bf16-weights")


def pure_bf16_space(placements: Sequence[str], states: Sequence[str],
                    distributions: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """The placements, moment precisions and distributions a pure bf16 set-up can take: AdamW on the device or
    offloaded (no "offload-bf16-weights": there is no master to keep), fp32 or bf16 moments (bitsandbytes' int8
    rounds the weight to nearest), one process or DDP (not FSDP2's sharded parameters)."""
    kept = [p for p in placements if p != "offload-bf16-weights"]
    if "offload-bf16-weights" in placements and "offload" not in kept:
        kept.append("offload")
    # Its rules obeyed (with int8 moments, with FSDP2): the search and the hint never propose what they refuse.
    return (kept, [s for s in states if not PURE_BF16_INT8.refuses(SetUp(pure_bf16=True, state_precision=s))],
            [d for d in distributions if not PURE_BF16_FSDP.refuses(SetUp(pure_bf16=True, fsdp=d == "fsdp2"))])

class PureBF16Technique(Technique):
    """bf16 weights with no fp32 master: only where asked for."""

    name = "pure bf16"
    fields = ("pure_bf16",)
    rules = (PURE_BF16_INT8, PURE_BF16_PRECISION, PURE_BF16_FSDP, PURE_BF16_CAST_WEIGHTS)
    search = ()  # never the search's: it changes the numerics

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """Only pure bf16 set-ups where asked; otherwise none (the plan computes them for a hint only)."""
        return Fixing({"pure_bf16": True if choices.pure_bf16 else None})

    def left_open(self, fixed: Any) -> list[str]:
        """Nothing to fix where the plan cannot choose: never planned: on only where asked."""
        return []

    def reasons(self, view: PlanView) -> list[str]:
        """No line of its own: its words are the optimizer's (pure bf16 AdamW, as asked)."""
        return []

    def computes_in(self, choices: Any) -> tuple[str, str] | None:
        if not choices.pure_bf16:
            return None
        return "bf16-mixed", "pure bf16 (bf16 weights, no fp32 master) computes in bf16"

    def kept(self, kept: Any) -> dict[str, Any]:
        """Bf16 weights with no master stay so (an fp32 run's plan may still weigh them for its hint: None)."""
        return {"pure_bf16": True if kept.pure_bf16 else None}

    def planned_setup(self, record: Any) -> dict[str, Any]:
        return {"pure_bf16": record.pure_bf16}

    def chosen(self, settings: Any) -> dict[str, Any]:
        return {"pure_bf16": settings.pure_bf16}

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        """Asked for: only pure bf16 set-ups (parameter offload's rule with it is parameter offload's to obey)."""
        if fixed.pure_bf16:
            space.placements, space.states, space.distributions = pure_bf16_space(
                space.placements, space.states, space.distributions)
            space.pure_bf16 = True

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        """Pure bf16 set-ups only where the space is narrowed to them (asked for, or the hint's search)."""
        return [{"pure_bf16": space.pure_bf16}]

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        """Pure bf16 where asked for (its rules with the optimizer and the precision are checked by ``trace``)."""
        return {"pure_bf16": bool(setup.pure_bf16)}, []

    def planned_options(self, settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
        """Pure bf16 where the plan has it (only where asked for)."""
        return {"pure_bf16": settings.pure_bf16}

    def setup_text(self, setup: Any) -> str:
        return "pure bf16 (bf16 weights, no master)" if setup.pure_bf16 else ""

    def trainer_problems(self, choices: Any) -> list[str]:
        """The Trainer helper trains the model's own weights (with an fp32 master where offloaded): no bf16-only
        weights."""
        if not choices.pure_bf16:
            return []
        return [Message(f"{arg('pure_bf16', True)}: MemtrainTrainer trains the model's own weights with the Trainer's "
                        "AdamW (or CPUOffloadOptimizer, with an fp32 master); it builds no bf16-only weights with "
                        f"stochastic rounding (PureBF16AdamW). To resolve this error, drop {arg('pure_bf16')} "
                        "(bf16=True in the TrainingArguments is bf16 autocast over fp32 weights), or train with "
                        "`memtrain train --pure-bf16`.")]


    def kept_differences(self, choices: Any, kept: Any) -> list[tuple[str, str]]:
        """Pure bf16 asked for where the run keeps an fp32 master (False is unset: the run's own)."""
        if choices.pure_bf16 and not kept.pure_bf16:
            return [(Message(arg("pure_bf16", True)), Message(arg("pure_bf16", True)))]
        return []


TECHNIQUE = PureBF16Technique()
