"""TrainConfig (memtrain.config): every problem of a config found at once, each named as the argument and saying
how to resolve it."""

from __future__ import annotations

import pytest

from memtrain import ConfigError, TrainConfig


def test_train_config_lists_every_problem():
    with pytest.raises(ConfigError) as info:
        TrainConfig(max_steps=0, lr=-1.0, precision="fp8", resume=True, overwrite=True).validate()
    assert len(info.value.problems) == 5, info.value.problems


def test_every_train_config_problem_says_how_to_resolve_it():
    bad = dict(max_steps=0, micro_batch_size=0, lr=-1.0, warmup_steps=-1, seed=-1, min_lr_ratio=2.0,
               weight_decay=-1.0, grad_clip=0.0, compile="yes", chunked_loss="yes", safety_margin=2.0,
               state_precision="fp8", offload_fraction=2.0, precision="fp8", sample_bytes=True, checkpointing=None,
               budget="lots")
    with pytest.raises(ConfigError) as info:
        TrainConfig(**bad).validate()
    assert len(info.value.problems) >= len(bad), info.value.problems
    assert all("To resolve this error" in p for p in info.value.problems), info.value.problems


def test_train_config_errors_name_arguments_and_suggest_only_what_it_accepts():
    bad = TrainConfig(max_steps=0, lr=float("nan"), seed=-1, checkpointing="sometimes", precision="fp8",
                      overwrite=True, resume=True, offload_optimizer=True, fsdp=True, warmup_steps=-1)
    with pytest.raises(ConfigError) as info:
        bad.validate()
    problems = info.value.problems
    assert not [p for p in problems if "--" in p], problems  # flags are the CLI's words, not the library's
    assert any("out_dir='DIR'" in p for p in problems), problems
    checkpointing = next(p for p in problems if p.startswith("checkpointing="))
    assert "'every:K'" in checkpointing and "'selective'" in checkpointing, checkpointing
    for accepted in ("every:2", "selective", "blocks(RK)", "all+offload", "auto"):  # what the message suggests
        TrainConfig(checkpointing=accepted).validate()
    TrainConfig(checkpointing="every", checkpoint_every=2).validate()  # the older spelling still works
