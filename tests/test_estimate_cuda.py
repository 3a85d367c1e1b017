"""CUDA's rules on the CPU's kernels: the attention kernel CUDA picks, autocast's op lists, 512-byte blocks."""

from __future__ import annotations

import pytest
from helpers import tiny_llama_config

from memtrain.estimate import estimate
from memtrain.models import GPT, GPT_PRESETS

transformers = pytest.importorskip("transformers")

B, T = 2, 32
V = 256


def test_cuda_rules_pick_the_attention_kernel():
    """fp32 grouped-query attention has no fused CUDA kernel: the math kernel saves the T x T attention matrix.
    bf16 goes to flash attention, and so does a model without grouped-query heads in fp32 (memory-efficient)."""
    t, heads, layers = 256, 4, 2
    gqa = tiny_llama_config(vocab_size=V, num_hidden_layers=layers, max_position_embeddings=t)
    mha = tiny_llama_config(vocab_size=V, num_hidden_layers=layers, num_key_value_heads=heads, max_position_embeddings=t)
    attention_matrices = layers * 1 * heads * t * t * 4
    fp32_gqa = estimate(gqa, (1, t), precision="fp32").activation_bytes
    bf16_gqa = estimate(gqa, (1, t), precision="bf16-mixed").activation_bytes
    fp32_mha = estimate(mha, (1, t), precision="fp32").activation_bytes
    # (the MHA model's larger key/value projections save a little more, hence 0.9)
    assert fp32_gqa - fp32_mha >= 0.9 * attention_matrices, (fp32_gqa, fp32_mha, attention_matrices)
    assert bf16_gqa < fp32_mha < fp32_gqa, (bf16_gqa, fp32_mha, fp32_gqa)


def test_cuda_autocast_rules_and_allocator_rounding():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    fp32 = estimate(model, (4, 64), precision="fp32")
    bf16 = estimate(model, (4, 64), precision="bf16-mixed")
    assert bf16.activation_bytes < fp32.activation_bytes, (bf16.activation_bytes, fp32.activation_bytes)
    cpu = estimate(model, (4, 64), device="cpu")
    # Every CUDA block is a multiple of 512 bytes, and cuBLAS workspaces come on top.
    assert fp32.peak_bytes % 512 == 0 and fp32.peak_bytes > cpu.peak_bytes + 32 * 2**20
    # With checkpointing the recompute runs under the same (emulated) autocast as the forward: no dtype mismatch.
    estimate(model, (4, 64), precision="bf16-mixed", checkpointing="all")
