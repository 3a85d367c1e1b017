"""The live tracker: the steady-state peak holds model state and activations; replaying identical meta calls
changes nothing."""

from __future__ import annotations

import pytest
from helpers import tiny_llama_config

from memtrain.estimate import estimate

transformers = pytest.importorskip("transformers")

V = 256


def test_steady_state_peak_holds_model_state_and_activations():
    """Without checkpointing the peak comes at the start of backward: everything saved is still alive."""
    model = transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=V, max_position_embeddings=128))
    r = estimate(model, (4, 64), device="cpu", optimizer="adamw")
    steps = 4 * len(list(model.parameters()))  # a float32 step tensor each
    assert r.optimizer_state_bytes == 2 * r.parameter_bytes + steps  # fp32 exp_avg + exp_avg_sq
    floor = r.parameter_bytes + r.optimizer_state_bytes + r.activation_bytes
    assert r.peak_bytes > floor, (r.peak_bytes, floor)
    # Its largest extra is the fp32 loss on the logits: log-softmax output, its grad, the logits grad.
    logits_fp32 = 4 * 64 * V * 4
    # (less a few KiB: the loss's own small saved tensors are freed by the time its gradients exist)
    assert r.peak_bytes >= floor + 2 * logits_fp32 - 4096, (r.peak_bytes, floor, logits_fp32)
    assert "logits" in r.peak_phase, r.peak_phase
    names = [phase for phase, _ in r.phase_bytes]
    assert names == ["forward", "backward", "step"], names


def test_replaying_identical_meta_calls_changes_nothing():
    config = tiny_llama_config(vocab_size=V, max_position_embeddings=128, num_hidden_layers=3)
    for policy in ("none", "all"):
        fast = estimate(config, (2, 64), precision="bf16-mixed", checkpointing=policy)
        slow = estimate(config, (2, 64), precision="bf16-mixed", checkpointing=policy, replay=False)
        assert (fast.peak_bytes, fast.activation_bytes, fast.phase_bytes) == (
            slow.peak_bytes, slow.activation_bytes, slow.phase_bytes), (policy, fast, slow)
