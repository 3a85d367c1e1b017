"""Activation offload, simulated: what leaves the device in forward is what the host holds."""

from __future__ import annotations

import pytest
from helpers import tiny_llama_config

from memtrain.choices import Choices
from memtrain.estimate import estimate

transformers = pytest.importorskip("transformers")

V = 256


def test_activation_offload_moves_saved_bytes_to_the_host():
    """Offloaded: every saved storage of 1 MiB or more that is not a weight; with checkpointing, the blocks' inputs."""
    config = tiny_llama_config(vocab_size=V, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=256)
    b, t = 4, 256
    hidden = b * t * 512 * 4  # one block input: the fp32 residual stream, 2 MiB
    kept = estimate(config, (b, t), checkpointing="all")
    offloaded = estimate(config, (b, t), checkpointing="all", setup=Choices(offload_activations=True))
    assert offloaded.host_bytes == 4 * hidden, (offloaded.host_bytes, 4 * hidden)
    assert offloaded.activation_bytes == kept.activation_bytes  # still saved, only elsewhere
    after_forward = dict(kept.phase_bytes)["forward"] - dict(offloaded.phase_bytes)["forward"]
    assert after_forward == 4 * hidden, (after_forward, 4 * hidden)  # all of them off the device then
    assert offloaded.peak_bytes <= kept.peak_bytes, (offloaded.peak_bytes, kept.peak_bytes)
    plain = estimate(config, (b, t))
    plain_offloaded = estimate(config, (b, t), setup=Choices(offload_activations=True))
    assert plain_offloaded.host_bytes > 0.5 * plain.activation_bytes, (plain_offloaded.host_bytes,
                                                                       plain.activation_bytes)
    moved = dict(plain.phase_bytes)["forward"] - dict(plain_offloaded.phase_bytes)["forward"]
    assert moved == plain_offloaded.host_bytes, (moved, plain_offloaded.host_bytes)
    assert plain_offloaded.peak_bytes < plain.peak_bytes, (plain_offloaded.peak_bytes, plain.peak_bytes)
