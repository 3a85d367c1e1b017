"""Chunked loss: the loss's fp32 logits 1024 tokens at a time, never the whole batch's (``memtrain.loss``). Its
setting is ``Choices.chunked_loss``; it has no rule with the other techniques (a model whose loss cannot be chunked
is refused where the model is known).
"""

from __future__ import annotations

from dataclasses import field

from memtrain.setting import flag
from memtrain.techniques.rule import Rule

FIELD = field(default=None, metadata=flag(
    "--chunked-loss", "the loss's fp32 logits 1024 tokens at a time, never whole ({unset})", kind="switch",
    off="on with checkpointing where the model allows it"))

FIELDS = ("chunked_loss",)  # the Choices fields this technique owns
RULES: tuple[Rule, ...] = ()
