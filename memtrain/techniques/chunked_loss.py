"""Chunked loss: the loss's fp32 logits 1024 tokens at a time, never the whole batch's (``memtrain.loss``). Its
setting is ``Choices.chunked_loss``; it has no rule with the other techniques, one with the model (a model whose loss
``memtrain.loss`` cannot chunk), which every site that knows the model asks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import field
from typing import Any

from memtrain.loss import apply_chunked_loss, chunked_loss_implementation, output_head
from memtrain.message import Message, arg
from memtrain.setting import flag
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace

FIELD = field(default=None, metadata=flag(
    "--chunked-loss", "the loss's fp32 logits 1024 tokens at a time, never whole ({unset})", kind="switch",
    off="on with checkpointing where the model allows it"))

CHUNKED_LOSS_MODEL = Rule(
    "chunked-loss-model",
    "memtrain.loss cannot chunk this model's loss: it chunks memtrain's GPT, GPT-2 and the Hugging Face causal LMs "
    "whose forward is Llama's (a linear head on the last hidden state, at most a scaling or soft-capping of the "
    "logits, cross-entropy), as memtrain.logit_steps reads it.",
    f"pass {arg('chunked_loss', False)}",
    ("chunked_loss", "chunkable"),
    lambda s: bool(s.chunked_loss) and s.chunkable is False)


def with_unset_default(setup: Any, chunkable: bool) -> Any:
    """``setup`` (a ``Choices``) with the chunked loss it leaves unset decided as where no plan chooses (``memtrain
    estimate``): on with checkpointing (a policy other than "none"), where ``memtrain.loss`` can chunk the model's
    loss; off otherwise. A chunked loss given stays."""
    if setup.chunked_loss is not None:
        return setup
    policy = setup.checkpointing
    return dataclasses.replace(setup, chunked_loss=policy is not None and policy.mode != "none" and chunkable)


def loss_tail(tails: Any, cfg: Any) -> Any:
    """The profiles' head and loss of ``cfg``'s loss (``tails``: the planner's ``TailProfile`` by chunked or not)."""
    return tails[cfg.chunked_loss]


def timed_share(cfg: Any, kept_share: float) -> float:
    """The share of the positions the loss's head runs on, as the step is timed: ``kept_share`` (the labels that
    count) for the chunked loss run eagerly; every position for the whole-logits loss, and for a compiled step, whose
    graph takes one size (``memtrain.run.step`` passes it no count)."""
    return kept_share if cfg.chunked_loss and not cfg.compile else 1.0


class ChunkedLossTechnique(Technique):
    """The loss's logits a chunk of tokens at a time: on, off, or the plan's."""

    name = "chunked loss"
    fields = ("chunked_loss",)
    rules = (CHUNKED_LOSS_MODEL,)
    search = ("chunked-loss",)

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """The chunked loss as given (None: the plan's)."""
        return Fixing({"chunked_loss": choices.chunked_loss})

    def left_open(self, fixed: Any) -> list[str]:
        """What fixes this technique where the plan cannot choose it (``fixed``: a plan's ``Fixed``)."""
        return [Message(arg("chunked_loss", False))] if fixed.chunked_loss is None else []

    def planned_setup(self, record: Any) -> dict[str, Any]:
        return {"chunked_loss": record.chunked_loss}

    def chosen(self, settings: Any) -> dict[str, Any]:
        return {"chunked_loss": settings.chunked_loss}

    def reasons(self, view: PlanView) -> list[str]:
        """The loss whole or chunked, against the other."""
        if not view.chunkable:
            return ["loss on the whole logits: memtrain does not chunk this model's loss"]
        chunked = view.settings.chunked_loss
        other = view.alternative(~view.same("chunked_loss"), "the whole-logits loss" if chunked else "the chunked loss")
        return [("loss 1024 tokens of logits at a time (chunked)" if chunked else "loss on the whole logits")
                + (f", because: {other}" if other else "")]

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """Both losses where memtrain can chunk this model's, else the whole one."""
        space.losses = [False, True] if problem.chunkable else [False]

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        if fixed.chunked_loss is not None:
            space.losses = [fixed.chunked_loss]

    def setup_text(self, setup: Any) -> str:
        return "a chunked loss" if setup.chunked_loss else ""

    def planned_text(self, settings: Any) -> str:
        """The loss in one word: "chunked" (1024 tokens of logits at a time) or "whole"."""
        return "chunked" if settings.chunked_loss else "whole"

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        return [{"chunked_loss": chunked} for chunked in space.losses]

    def trainer_default(self, choices: Any) -> dict[str, Any]:
        """The loss chunked where the choice is open (the Trainer helper runs no plan)."""
        return {"chunked_loss": True} if choices.chunked_loss is None else {}

    def prepare_model(self, model: Any, choices: Any, *, chunk_tokens: int) -> dict[str, Any]:
        """The model's loss chunked, ``chunk_tokens`` tokens of logits at a time, with the kernel it takes."""
        if not choices.chunked_loss:
            return {}
        apply_chunked_loss(model, chunk_tokens=chunk_tokens)
        kind, why = chunked_loss_implementation(output_head(model))
        return {"reasons": [f"loss: {chunk_tokens} tokens of logits at a time with {kind}'s kernel, because: {why}"]}

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        """The loss chunked where asked for (None: whole)."""
        return {"chunked_loss": bool(setup.chunked_loss)}, []

    def planned_options(self, settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
        """The loss chunked or whole, as planned."""
        return {"chunked_loss": settings.chunked_loss}


TECHNIQUE = ChunkedLossTechnique()
