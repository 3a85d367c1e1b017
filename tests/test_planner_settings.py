"""Tests of memtrain.planner: Plan: its summary, JSON and host-link bytes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_llama_config

from memtrain.models import GPT, GPTConfig
from memtrain.planner import (
    PlanSettings,
    known_gpu,
    plan,
    predictions,
)

transformers = pytest.importorskip("transformers")

H100 = known_gpu("NVIDIA H100 80GB HBM3")
MiB = 2**20


def _llama(layers: int = 4, hidden: int = 512, **overrides):
    return tiny_llama_config(**{**dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                       num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                                       max_position_embeddings=2048, use_cache=False), **overrides})


@pytest.fixture(scope="module")
def llama():
    return _llama()


# -- bytes over the host link, and what compile_model compiles ------------------------------------------------
def _offload_gpt() -> GPT:
    # Block inputs of 256 x 256 fp32 per example: 256 KiB at micro-batch 1, the offloader's 1 MiB at 4.
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, seq_len=256, vocab_size=256, dropout=0.0))


def test_summary_and_json(llama):
    p = plan(llama, budget=int(160 * MiB), seq_len=1024, global_batch_size=4, device_profile=H100)
    table = p.summary()
    assert "choice:" in table and "runners-up" in table and "because:" in table, table
    doc = json.loads(json.dumps(p.to_dict()))
    assert set(doc) >= {"plan", "peak_bytes", "step_seconds", "tokens_per_s", "candidates", "reasons"}
    assert doc["plan"]["micro_batch_size"] == p.micro_batch_size and doc["candidates"]
    assert all(c["lost_because"] for c in doc["candidates"])


def test_a_plan_reports_its_host_link_bytes():
    model = _offload_gpt()
    s = PlanSettings(4, 1, ("offload", "keep"), "full", False, "offload", "none", False, "fp32")
    p = plan(model, budget=None, seq_len=256, global_batch_size=4, device_profile=H100, settings=s,
             host_budget="64GiB")
    (c,) = predictions(model, [s], seq_len=256, global_batch_size=4, device="cuda", device_profile=H100)
    assert p.host_link == c.host_link and p.host_link_bytes == c.host_link.total > 0
    assert all(r.host_link is not None for r in p.candidates)
    assert p.host_link.activations_to_host > 0 and p.host_link.optimizer_to_host > 0, p.host_link
    assert json.loads(json.dumps(p.to_dict()))["host_link"] == p.host_link.to_dict()
    assert "host link per step:" in p.summary(), p.summary()
