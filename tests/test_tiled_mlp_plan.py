"""The planner weighs the tiled MLP (memtrain.tiled_mlp) where sequences span 4 tiles or more, picks it where only it
fits, and says why; it does not weigh it below that."""

from __future__ import annotations

import transformers
from helpers import h100

from memtrain.choices import Choices
from memtrain.planner import plan
from memtrain.techniques.optimizer import OptimizerChoice

SEQ = 4096


def _llama(positions: int = SEQ) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=positions)


# Everything but the MLP fixed: the search has one other choice to make (the micro-batch is 1).
FIXED = dict(checkpointing="all", offload_activations=False, chunked_loss=True, offload_weights=False,
             optimizer=OptimizerChoice(placement="device", state_precision="fp32", step_in_backward=False,
                                       offload_fraction=0.0))


def _plan(seq: int = SEQ, **kwargs):
    return plan(_llama(), seq_len=seq, global_batch_size=1, micro_batch_size=1, device="cuda",
                device_profile=h100(), **kwargs)


def test_the_plan_tiles_the_mlp_where_only_that_fits_and_says_why():
    whole = _plan(budget=None, choices=Choices(**FIXED, tiled_mlp=False))
    tiled = _plan(budget=None, choices=Choices(**FIXED, tiled_mlp=True))
    assert tiled.peak_bytes < whole.peak_bytes, (tiled.peak_bytes, whole.peak_bytes)
    usable = (tiled.peak_bytes + whole.peak_bytes) // 2
    chosen = _plan(budget=int(usable / 0.95) + 1, choices=Choices(**FIXED))
    assert chosen.settings.tiled_mlp and chosen.peak_bytes == tiled.peak_bytes
    line = next(r for r in chosen.reasons if r.startswith("MLP"))
    assert line.startswith("MLP over tiles of the hidden size's count of tokens (tiled), because: the whole MLP "
                           "would peak at"), line
    assert "loss chunked, tiled MLP, optimizer" in chosen.summary()
    loose = _plan(budget=None, choices=Choices(**FIXED))
    assert not loose.settings.tiled_mlp  # one more forward of the MLP: slower where both fit
    assert any(r.startswith("MLP whole, because: the tiled MLP would be") for r in loose.reasons), loose.reasons


def test_short_sequences_do_not_weigh_the_tiled_mlp():
    """At 192 tokens (3 tiles of 64) tiling saves little and costs a second copy of the MLP's weight gradients: the
    plan neither weighs it nor says anything of it."""
    chosen = _plan(seq=192, budget=None, choices=Choices(**FIXED))
    assert not chosen.settings.tiled_mlp
    assert not any(r.startswith("MLP") for r in chosen.reasons), chosen.reasons
