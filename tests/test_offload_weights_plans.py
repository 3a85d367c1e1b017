"""The planner and parameter offload: tried only when nothing else fits, with its reasons; issue 20's targets (a 13B
on a 24 GiB 4090, a 70B on one 80 GiB H100, full fine-tuning) fit only with it."""

from __future__ import annotations

import pytest
from helpers import h100, planner_llama

from memtrain.errors import ConfigError
from memtrain.planner import plan


def test_the_plan_streams_weights_only_when_nothing_else_fits():
    model = planner_llama(layers=8, hidden=512)
    common = dict(seq_len=256, global_batch_size=4, device="cuda", device_profile=h100(), host_budget="8GiB")
    roomy = plan(model, budget="160MiB", **common)
    assert not roomy.settings.offload_weights, roomy.summary()
    assert any(r.startswith("the weights on the device, because: they fit") for r in roomy.reasons), roomy.reasons
    tight = plan(model, budget="120MiB", **common)
    assert tight.settings.offload_weights and tight.settings.optimizer != "device", tight.summary()
    why = next(r for r in tight.reasons if r.startswith("parameter offload"))
    assert "because: the weights on the device would peak at" in why, why
    assert tight.peak_bytes <= tight.usable_bytes
    # Every block crosses the link twice a micro-batch; only the other weights go back after the step.
    link = tight.host_link
    assert link.weights_to_device > 0 and link.optimizer_to_device < link.weights_to_device / 2, link



def test_the_plan_does_not_stream_a_frozen_base():
    """LoRA's and QLoRA's frozen base stays on the device (the streamer moves the weights the optimizer trains):
    streaming only the adapters saves next to nothing, and a 4-bit base cannot stream at all."""
    from memtrain.estimate import meta_model

    model = meta_model(planner_llama(layers=8, hidden=512))
    for name, p in model.named_parameters():
        p.requires_grad_(".layers." not in name or name.endswith("o_proj.weight"))  # one trained matrix a block
    common = dict(seq_len=256, global_batch_size=4, device="cuda", device_profile=h100(), host_budget="8GiB")
    with pytest.raises(ConfigError, match="no set-up fits") as refused:  # what fits here streams the weights
        plan(model, budget="120MiB", **common)
    assert "weights streamed" not in str(refused.value), refused.value
    assert not plan(model, budget="140MiB", **common).settings.offload_weights  # 140: torch 2.11 traces need it

# Issue 20's targets (a 13B on a 24 GiB 4090, a 70B on one 80 GiB H100, full fine-tuning) fit only with parameter
# offload: the README's "Fit an 8B on a 24 GB GPU" shows their plans, which tests/test_readme_24gb.py runs.
