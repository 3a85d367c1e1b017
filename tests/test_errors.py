"""Every error memtrain raises on purpose says how to fix it; other libraries' errors keep their cause."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from memtrain.errors import ConfigError, MemtrainError, describe_exception


def _bad_calls():
    from memtrain.accumulation import GradientAccumulator, accumulation_steps
    from memtrain.checkpointing import Checkpointing, apply_checkpointing
    from memtrain.choices import Choices, OptimizerChoice
    from memtrain.data import (
        ByteWindows,
        LengthBucketSampler,
        PackCollate,
        PadCollate,
        TokenDocuments,
        split_windows,
    )
    from memtrain.estimate import estimate
    from memtrain.loss import chunked_cross_entropy
    from memtrain.models import GPT, GPT_PRESETS

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gpt = GPT(GPT_PRESETS["gpt-tiny"])
    return {
        "accumulation_steps": lambda: accumulation_steps(0, 8),
        "accumulator arguments": lambda: GradientAccumulator("model", "opt", steps=2, max_grad_norm=-1,
                                                             scaler="s", scheduler=object()),
        "is_last": lambda: GradientAccumulator(model, optimizer, steps=2).micro_batch(is_last="yes").__enter__(),
        "apply_checkpointing not a module": lambda: apply_checkpointing("model"),
        "offload_inputs": lambda: Checkpointing(mode="all", offload_inputs="yes"),
        "n_blocks": lambda: Checkpointing().block_policies(-1),
        "ByteWindows seq_len": lambda: ByteWindows(np.zeros(10, dtype=np.uint8), 0),
        "val_fraction": lambda: split_windows(np.zeros(100, dtype=np.uint8), 4, val_fraction=2),
        "documents": lambda: TokenDocuments(np.zeros((2, 2)), np.array([0, 5]), np.array([1])),
        "min_len": lambda: TokenDocuments.from_texts(["abc"], min_len=0),
        "pad_to_multiple_of": lambda: PadCollate(pad_to_multiple_of=0),
        "PackCollate seq_len": lambda: PackCollate(seq_len=0),
        "sampler": lambda: LengthBucketSampler([3, 4], batch_size=0, rank=3, world_size=2, seed=-1),
        "estimate flags": lambda: estimate(gpt, (2, 16), device="cpu", checkpointing="every:2", optimizer="sgd",
                                           accumulation=0, setup=Choices(checkpointing="all", optimizer=OptimizerChoice(
                                               placement="offload"))),
        "loss implementation": lambda: chunked_cross_entropy(torch.zeros(2, 4), nn.Linear(4, 8),
                                                             torch.zeros(2, dtype=torch.long), implementation="x"),
    }


@pytest.mark.parametrize("case", ["accumulation_steps", "accumulator arguments", "is_last",
                                  "apply_checkpointing not a module", "offload_inputs", "n_blocks",
                                  "ByteWindows seq_len", "val_fraction", "documents", "min_len", "pad_to_multiple_of",
                                  "PackCollate seq_len", "sampler", "estimate flags", "loss implementation"])
def test_every_problem_of_a_config_error_says_how_to_resolve_it(case):
    with pytest.raises(MemtrainError) as info:
        _bad_calls()[case]()
    problems = info.value.problems if isinstance(info.value, ConfigError) else (str(info.value),)
    missing = [p for p in problems if "To resolve this error" not in p]
    assert not missing, f"{case}: problems without a fix: {missing}"


def test_describe_exception_keeps_a_short_message_whole_and_the_cause():
    try:
        try:
            raise KeyError("inner reason")
        except KeyError as cause:
            raise ValueError("outer\nmiddle\nlast line") from cause
    except ValueError as e:
        text = describe_exception(e)
    assert text == "ValueError: outer middle last line (caused by KeyError: 'inner reason')", text


def test_describe_exception_keeps_the_first_and_last_line_of_a_long_message():
    message = "what failed\n" + "\n".join(f"context line {i}" for i in range(200)) + "\nthe reason"
    text = describe_exception(OSError(message), max_chars=200)
    assert text == "OSError: what failed ... the reason", text
    assert describe_exception(RuntimeError()) == "RuntimeError: (no message)"
