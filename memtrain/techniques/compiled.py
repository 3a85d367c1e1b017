"""Compile: ``torch.compile`` the step (fused kernels; the first steps compile). Its setting is
``Choices.compile`` (True: train compiles, plan also considers compiled set-ups); its flag is each command's own,
and parameter offload's rule with it is parameter offload's.
"""

from __future__ import annotations

from memtrain.techniques.rule import Rule

FIELDS = ("compile",)  # the Choices fields this technique owns
RULES: tuple[Rule, ...] = ()
