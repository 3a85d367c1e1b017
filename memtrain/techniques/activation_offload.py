"""Activation offload: the tensors saved for backward live in pinned host memory, copied out on a side stream and
prefetched before backward needs them (PCIe traffic instead of device bytes; CUDA only). Its setting is
``Choices.offload_activations`` (a checkpointing policy's "+offload" asks for it too); its rule with checkpointing
follows.
"""

from __future__ import annotations

from dataclasses import field

from memtrain.setting import flag
from memtrain.techniques.rule import Rule

FIELD = field(default=None, metadata=flag(
    "--offload-activations", "saved activations in pinned host memory, prefetched before backward (CUDA; "
    "{unset})", kind="switch"))

CHECKPOINT_OFFLOAD_INPUTS = Rule(
    "checkpoint-offload-inputs",
    "the policy offloads the recomputed blocks' inputs, but offload_activations=False says not to.",
    "drop +offload or offload_activations=False",
    ("checkpointing", "offload_activations"),
    lambda s: s.checkpointing is not None and s.checkpointing.offload_inputs and s.offload_activations is False,
    shows_false=("offload_activations",))

FIELDS = ("offload_activations",)  # the Choices fields this technique owns
RULES: tuple[Rule, ...] = (CHECKPOINT_OFFLOAD_INPUTS,)
