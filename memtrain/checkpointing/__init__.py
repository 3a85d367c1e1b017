"""Activation checkpointing: recompute each block in backward instead of keeping its activations.

- ``selective``: the op-level policy (``SelectivePolicy``): keep matmul/attention outputs, recompute the rest;
- ``blocks``: finding the repeated blocks (``find_blocks``) and the explicit block selectors;
- ``forward``: the checkpointed forward of a wrapped block (RNG-exact, BatchNorm-safe, keywords passed through);
- ``compile``: ``compile_model``, torch.compile whole or block by block around activation offloaders;
- ``wrap``: ``apply_checkpointing``, ``remove_checkpointing``, ``checkpoint_sequential``, ``checkpoint_spec``;
- ``policy``: ``Checkpointing``, the one typed policy value and its spellings.
"""

from memtrain.checkpointing.blocks import BlockPolicy, BlockSelector, find_blocks
from memtrain.checkpointing.compile import compile_model
from memtrain.checkpointing.forward import CheckpointedForward, CheckpointSpec, checkpointed_blocks
from memtrain.checkpointing.policy import Checkpointing, CheckpointingMode
from memtrain.checkpointing.selective import OpKind, SelectivePolicy
from memtrain.checkpointing.wrap import (
    apply_checkpointing,
    checkpoint_sequential,
    checkpoint_spec,
    remove_checkpointing,
)

__all__ = [
    "BlockPolicy",
    "BlockSelector",
    "CheckpointSpec",
    "CheckpointedForward",
    "Checkpointing",
    "CheckpointingMode",
    "OpKind",
    "SelectivePolicy",
    "apply_checkpointing",
    "checkpoint_sequential",
    "checkpoint_spec",
    "checkpointed_blocks",
    "compile_model",
    "find_blocks",
    "remove_checkpointing",
]
