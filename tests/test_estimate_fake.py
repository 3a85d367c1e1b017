"""The step's inputs without data: a meta model, a config and the real model agree; every batch form agrees; a
Hugging Face config file; a model already checkpointed."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama_config

from memtrain import apply_checkpointing
from memtrain.errors import ConfigError
from memtrain.estimate import estimate, hf_config_from_file
from memtrain.models import GPT, GPT_PRESETS

transformers = pytest.importorskip("transformers")

B, T = 2, 32
V = 256


def test_meta_model_and_config_give_the_same_estimate_as_the_real_model():
    torch.manual_seed(0)
    real = GPT(GPT_PRESETS["gpt-tiny"])
    with torch.device("meta"):
        meta = GPT(GPT_PRESETS["gpt-tiny"])
    a, b = estimate(real, (4, 64), device="cpu"), estimate(meta, (4, 64), device="cpu")
    assert (a.activation_bytes, a.peak_bytes) == (b.activation_bytes, b.peak_bytes)

    config = tiny_llama_config(vocab_size=V, max_position_embeddings=128)
    from_config = estimate(config, (B, T))
    from_module = estimate(transformers.LlamaForCausalLM(config), (B, T))
    assert from_config.activation_bytes == from_module.activation_bytes
    assert from_config.peak_bytes == from_module.peak_bytes


def test_batch_forms_agree():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    tokens = torch.zeros(4, 64, dtype=torch.long, device="meta")
    reports = [
        estimate(model, tokens, device="cpu"),
        estimate(model, (4, 64), device="cpu"),
        estimate(model, None, micro_batch_size=4, seq_len=64, device="cpu"),
        estimate(model, (1, 16), micro_batch_size=4, seq_len=64, device="cpu"),
    ]
    assert len({r.activation_bytes for r in reports}) == 1, [r.activation_bytes for r in reports]
    assert estimate(model, (8, 64), device="cpu").activation_bytes > reports[0].activation_bytes


def test_hf_config_file_and_an_already_checkpointed_model(tmp_path):
    config = tiny_llama_config(vocab_size=V, max_position_embeddings=128)
    path = tmp_path / "config.json"
    config.to_json_file(path)
    loaded = hf_config_from_file(path)
    assert estimate(loaded, (B, T)).peak_bytes == estimate(config, (B, T)).peak_bytes
    (tmp_path / "bad.json").write_text('{"hidden_size": 64}')
    with pytest.raises(ConfigError, match="model_type"):
        hf_config_from_file(tmp_path / "bad.json")
    # A model already wrapped by apply_checkpointing is estimated with the policy asked for, and stays wrapped.
    model = GPT(GPT_PRESETS["gpt-tiny"])
    plain = estimate(model, (2, 64), checkpointing="all")
    apply_checkpointing(model, every=2)
    assert estimate(model, (2, 64), checkpointing="all").activation_bytes == plain.activation_bytes
    assert "forward" in model.blocks[0].__dict__ and "forward" not in model.blocks[1].__dict__
