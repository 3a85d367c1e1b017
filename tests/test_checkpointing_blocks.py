"""Finding the blocks: auto-detection (GPT, ResNet, alike Sequential blocks) and the explicit selectors."""

from __future__ import annotations

import copy

import pytest
import torch
from checkpointing_parity import assert_grads_equal, gpt, run_twice
from torch import nn

from memtrain import (
    ConfigError,
    apply_checkpointing,
)
from memtrain.checkpointing import checkpointed_blocks
from memtrain.models import GPT, GPTConfig, ResNet


def test_block_selectors():
    model = gpt(n_layer=4)
    from memtrain.models import MLP, Block

    assert apply_checkpointing(model, blocks=Block) == [f"blocks.{i}" for i in range(4)]
    assert apply_checkpointing(model, blocks=(MLP,)) == [f"blocks.{i}.mlp" for i in range(4)]
    assert apply_checkpointing(model, blocks=lambda name, m: name.endswith("attn")) == [
        f"blocks.{i}.attn" for i in range(4)
    ]
    assert apply_checkpointing(model, blocks=["blocks.1", "blocks.3"]) == ["blocks.1", "blocks.3"]



def test_resnet_blocks_auto_detected():
    names = apply_checkpointing(ResNet(layers=(2, 1, 1, 1), width=4))
    assert names == ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0"]



def _mlp_blocks(n: int = 4, width: int = 16) -> list[nn.Sequential]:
    return [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * width, width))
            for _ in range(n)]



class MLPStack(nn.Module):
    """Blocks written as plain nn.Sequential (no block class), and a head of the blocks' leaf class."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(_mlp_blocks(4, width))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)



@pytest.mark.parametrize("build", [lambda: nn.Sequential(*_mlp_blocks()), MLPStack], ids=["sequential", "modulelist"])
def test_identical_sequential_blocks_detected_with_equal_gradients(build):
    torch.manual_seed(0)
    model = build()
    names = apply_checkpointing(copy.deepcopy(model))
    prefix = "layers." if isinstance(model, MLPStack) else ""
    assert names == [f"{prefix}{i}" for i in range(4)], names
    x = torch.randn(8, 16)
    plain, wrapped, plain_report, wrapped_report = run_twice(model, lambda m: m(x).square().sum())
    assert_grads_equal(plain, wrapped)
    assert wrapped_report.activation_bytes < plain_report.activation_bytes, (
        f"saved bytes {plain_report.activation_bytes} -> {wrapped_report.activation_bytes}")



def test_a_head_of_the_blocks_leaf_class_is_not_wrapped():
    """The "same kind outside the container" rule is for composite blocks (a ResNet stage of one block); a lone
    nn.Linear head of the same class as leaf blocks would recompute a matmul to save nothing."""

    class LinearStack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    assert apply_checkpointing(LinearStack()) == ["layers.0", "layers.1", "layers.2"]
    assert apply_checkpointing(MLPStack()) == [f"layers.{i}" for i in range(4)]



def test_sequentials_that_differ_are_not_blocks_and_the_error_says_what_was_found():
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    with pytest.raises(ConfigError, match="no repeated blocks") as e:
        apply_checkpointing(model)
    message = str(e.value)
    assert "structurally identical" in message, message
    assert "the model itself is the largest container; it holds Sequential(Linear, GELU), Sequential(Linear, ReLU)" in message, message



def test_blocks_matching_nothing():
    with pytest.raises(ConfigError, match="matches no submodule"):
        apply_checkpointing(gpt(n_layer=2), blocks=nn.Conv2d)
    with pytest.raises(ConfigError, match="no submodule named 'blocks.9'"):
        apply_checkpointing(gpt(n_layer=2), blocks=["blocks.9"])
    with pytest.raises(ConfigError, match="no repeated blocks"):
        apply_checkpointing(nn.Linear(3, 3))



def test_an_empty_explicit_block_list_is_refused_not_silently_ignored():
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    for empty in ([], ()):
        with pytest.raises(ConfigError, match="blocks=.*selects no module.*To resolve this error"):
            apply_checkpointing(model, blocks=empty)
    assert checkpointed_blocks(model) == []
