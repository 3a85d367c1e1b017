"""Wrapping in place: the bytes checkpointing saves, no double wrapping, remove, checkpoint_sequential, and
every bad input reported at once."""

from __future__ import annotations

import copy

import pytest
import torch
from checkpointing_parity import assert_buffers_equal, assert_grads_equal, gpt, gpt_step, hf_llama, run_twice
from torch import nn

from memtrain import ConfigError, apply_checkpointing, remove_checkpointing
from memtrain.checkpointing import checkpoint_sequential, checkpointed_blocks


def test_checkpoint_sequential_parity_and_batchnorm():
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2)) for _ in range(4)])
    twin = copy.deepcopy(layers)
    x = torch.randn(8, 16)
    torch.manual_seed(5)
    layers(x).sum().backward()
    torch.manual_seed(5)
    checkpoint_sequential(twin, 2, x).sum().backward()
    assert_grads_equal(layers, twin)
    assert_buffers_equal(layers, twin)



def test_full_checkpointing_cuts_saved_bytes_at_least_10x_on_8_blocks():
    _, _, plain, wrapped = run_twice(gpt(dropout=0.0), gpt_step)
    ratio = plain.activation_bytes / wrapped.activation_bytes
    assert ratio >= 10, f"saved bytes {plain.activation_bytes} -> {wrapped.activation_bytes}: only {ratio:.1f}x"



def test_every_2_about_halves_saved_bytes():
    _, _, plain, wrapped = run_twice(gpt(dropout=0.0), gpt_step, every=2)
    ratio = wrapped.activation_bytes / plain.activation_bytes
    assert 0.4 <= ratio <= 0.6, f"every=2 kept {ratio:.2f} of the saved bytes ({wrapped.activation_bytes} bytes)"



def test_no_double_wrapping_and_remove():
    model = gpt(n_layer=4)
    first = apply_checkpointing(model)
    second = apply_checkpointing(model, every=2)
    assert first == [f"blocks.{i}" for i in range(4)]
    assert second == ["blocks.0", "blocks.2"]
    assert checkpointed_blocks(model) == second
    forward = model.blocks[0].forward
    assert forward.original.__self__ is model.blocks[0], "a wrapped forward must not wrap another wrapped forward"
    assert remove_checkpointing(model) == second
    assert checkpointed_blocks(model) == [] and "forward" not in model.blocks[0].__dict__



def test_state_dict_names_unchanged():
    model = gpt(n_layer=2)
    keys = list(model.state_dict())
    apply_checkpointing(model)
    assert list(model.state_dict()) == keys



@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_bad_every(every):
    with pytest.raises(ConfigError, match="every="):
        apply_checkpointing(gpt(n_layer=2), every=every)



def test_unknown_policy():
    with pytest.raises(ConfigError, match="unknown op kinds"):
        apply_checkpointing(gpt(n_layer=2), selective=("softmax",))
    with pytest.raises(ConfigError, match="not a policy"):
        apply_checkpointing(gpt(n_layer=2), selective=3)



def test_model_without_parameters():
    with pytest.raises(ConfigError, match="no parameters"):
        apply_checkpointing(nn.Sequential(nn.ReLU(), nn.ReLU()))



def test_module_already_wrapped_by_torch_checkpoint_wrapper():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = gpt(n_layer=2)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with pytest.raises(ConfigError, match="checkpoint_wrapper"):
        apply_checkpointing(model)



def test_hugging_face_checkpointing_already_enabled():
    model = hf_llama()
    model.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable"):
        apply_checkpointing(model)



def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        apply_checkpointing(gpt(n_layer=2), every=0, selective=("nope",), blocks=["missing"])
    assert len(info.value.problems) == 3, info.value.problems



def test_checkpoint_sequential_bad_segments():
    with pytest.raises(ConfigError, match="segments"):
        checkpoint_sequential(nn.Sequential(nn.Linear(2, 2)), 3, torch.randn(1, 2))
