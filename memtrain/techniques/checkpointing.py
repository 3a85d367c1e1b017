"""Activation checkpointing: the blocks that keep only their input and recompute the rest in backward (about one
extra forward of each such block), by a policy ("none", "all", "every:K", "selective", "blocks(RKO...)",
"...+offload") or, left ``None``, the plan's per-block keep / recompute / offload. Its setting is
``Choices.checkpointing`` (a ``Checkpointing``); its flag is each command's own (each parses and defaults it its
way). Its rule with activation offload is activation offload's.
"""

from __future__ import annotations

from typing import Any

from memtrain.checkpointing import Checkpointing
from memtrain.errors import ConfigError
from memtrain.techniques.rule import Rule

FIELDS = ("checkpointing",)  # the Choices fields this technique owns
RULES: tuple[Rule, ...] = ()


def policy_of(value: Any) -> tuple[Checkpointing | None, list[str]]:
    """The policy ``value`` spells (None or "auto": the plan's), and the problems with it, each naming the fix."""
    if value is None or isinstance(value, Checkpointing):
        return value, []
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None, []
    if isinstance(value, (bool, int)):  # parse would read 3 as every:3, True as all: a choice names its policy
        return None, [f"checkpointing={value!r} is not a policy. To resolve this error, pass 'auto', 'none', 'all', "
                      "'every:K' (e.g. 'every:2'), 'selective', or a Checkpointing."]
    try:
        return Checkpointing.parse(value), []
    except ConfigError as e:
        return None, [p if p.startswith("checkpointing") else f"checkpointing={value!r}: {p}" for p in e.problems]
