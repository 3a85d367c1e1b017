"""Tests of memtrain.planner: apply_plan: it sets up exactly what the settings say."""

from __future__ import annotations

import torch
from helpers import planner_gpt

from memtrain.checkpointing import checkpoint_spec, checkpointed_blocks
from memtrain.loss import chunk_tokens_of
from memtrain.optim import CPUOffloadOptimizer
from memtrain.planner import (
    PlanSettings,
    apply_plan,
)


# -- apply_plan ---------------------------------------------------------------------------------------------
def test_apply_plan_builds_the_lean_optimizer_the_settings_say():
    from memtrain.optim import ComposedOptimizer

    model = planner_gpt(layers=4)
    settings = PlanSettings(micro_batch_size=8, accumulation=1, blocks=("keep",) * 4, flavor="full",
                            chunked_loss=False, optimizer="device", distribution="none", compile=False,
                            precision="fp32",
                            state_precision="bf16", step_in_backward=True)
    run = apply_plan(model, settings, lr=1e-3, max_grad_norm=None)
    assert isinstance(run.optimizer, ComposedOptimizer) and run.optimizer.steps_in_backward
    x = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    with run.accumulator.micro_batch(is_last=True):
        run.accumulator.backward(model(x, x, reduction="sum"), reduction="sum", items=x.numel())
    run.accumulator.step()
    state = next(iter(run.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16
    run.optimizer.close()


def test_apply_plan_sets_up_exactly_what_the_settings_say():
    model = planner_gpt(layers=4)
    names = [f"blocks.{i}" for i in range(4)]
    settings = PlanSettings(micro_batch_size=2, accumulation=2,
                            blocks=("offload", "recompute", "recompute", "keep"), flavor="selective",
                            chunked_loss=True, optimizer="offload",
                            distribution="none", compile=False, precision="fp32")
    run = apply_plan(model, settings, lr=1e-3)
    assert checkpointed_blocks(model) == names[:3]
    specs = [checkpoint_spec(model.get_submodule(n)) for n in names[:3]]
    assert [s.policy for s in specs] == ["offload", "recompute", "recompute"]
    assert specs[1].selective is not None
    assert chunk_tokens_of(model) == 1024
    assert isinstance(run.optimizer, CPUOffloadOptimizer) and run.accumulator.steps == 2
    run.optimizer.close()
    plain = apply_plan(model, PlanSettings(micro_batch_size=4, accumulation=1, blocks=("keep",) * 4, flavor="full",
                                           chunked_loss=False, optimizer="device", distribution="none",
                                           compile=False, precision="fp32"))
    assert checkpointed_blocks(model) == [] and chunk_tokens_of(model) is None
    assert type(plain.optimizer) is torch.optim.AdamW


def test_offload_bf16_weights_puts_a_lora_models_frozen_base_in_bf16_too():
    """The plan estimates every device weight in bf16 with offload-bf16-weights (estimate(weights_dtype="bf16")):
    the frozen base of a LoRA model, which has no fp32 master to keep, is cast too, or the run would hold it in
    fp32 beside a plan that counted it in bf16."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from helpers import tiny_llama_config

    from memtrain.hf import apply_lora

    model = apply_lora(transformers.LlamaForCausalLM(tiny_llama_config()), 4)
    settings = PlanSettings(micro_batch_size=2, accumulation=1, blocks=("keep",) * 2, flavor="full",
                            chunked_loss=False, optimizer="offload-bf16-weights", distribution="none",
                            compile=False, precision="bf16-mixed")
    run = apply_plan(model, settings, lr=1e-3)
    wrong = {n: p.dtype for n, p in model.named_parameters() if p.dtype != torch.bfloat16}
    run.optimizer.close()
    assert not wrong, f"device weights not in bf16: {wrong}"
