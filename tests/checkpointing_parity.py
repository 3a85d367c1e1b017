"""What the checkpointing tests share: gradient and buffer equality, a seeded step on a plain and a checkpointed
copy, and the models they run (an 8-block GPT, a 4-layer Hugging Face Llama with attention dropout)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_gpt, tiny_llama_config
from torch import nn

from memtrain import apply_checkpointing, measure
from memtrain.models import GPT


def assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None, name
        diff = (pa.grad - pb.grad).abs().max().item()
        assert torch.equal(pa.grad, pb.grad), f"{name}: gradients differ, max abs diff {diff:.3e}"


def assert_buffers_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert torch.equal(ba, bb), f"buffer {name} differs: {ba.flatten()[:4]} vs {bb.flatten()[:4]}"


def run_twice(model: nn.Module, step, **checkpoint_kwargs) -> tuple[nn.Module, nn.Module, object, object]:
    """The same seeded step on a plain copy and a checkpointed copy; returns both models and their reports."""
    plain, wrapped = model, copy.deepcopy(model)
    apply_checkpointing(wrapped, **checkpoint_kwargs)
    torch.manual_seed(1234)
    plain_report = measure(lambda: step(plain), model=plain)
    torch.manual_seed(1234)
    wrapped_report = measure(lambda: step(wrapped), model=wrapped)
    return plain, wrapped, plain_report, wrapped_report


def gpt(n_layer: int = 8, dropout: float = 0.1) -> GPT:
    return tiny_gpt(n_layer, n_head=4, n_embd=128, seq_len=64, dropout=dropout, seed=0)


def gpt_step(model: GPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (4, 64), generator=g)
    return model(x, torch.roll(x, -1, dims=1))


def hf_llama():
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(num_hidden_layers=4, max_position_embeddings=64, attention_dropout=0.1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)
