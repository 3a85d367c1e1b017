"""The learning-rate schedule (memtrain.schedule): the rates of torch's own schedulers for each shape, the peak
chosen for pre-training, full fine-tuning and LoRA, the run's length from epochs, and AdamW's betas and eps in
every optimizer apply_plan builds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import tiny_gpt, tiny_llama_config

from memtrain import ConfigError, TrainConfig
from memtrain.planner import PlanSettings, apply_plan
from memtrain.schedule import (
    FULL_FINETUNING_LR,
    LORA_LR,
    PRETRAINING_LR,
    default_lr,
    lr_at,
    lr_scheduler,
    resolve_schedule,
    steps_for_epochs,
)


def _torch_rates(kind: str, lr: float, warmup: int, max_steps: int, min_ratio: float) -> list[float]:
    """The rates torch's schedulers give: a LinearLR warm-up chained (SequentialLR) to the schedule's shape."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / warmup, end_factor=1.0,
                                             total_iters=warmup - 1)
    after = {
        "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_steps - warmup,
                                                                     eta_min=lr * min_ratio),
        "linear": lambda: torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=min_ratio,
                                                            total_iters=max_steps - warmup),
        "constant": lambda: torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0),
    }[kind]()
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, after], milestones=[warmup])
    rates = []
    for _ in range(max_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_each_schedule_gives_the_rates_of_torchs_own_schedulers(kind):
    config = TrainConfig(max_steps=40, lr=2e-4, warmup_steps=5, lr_schedule=kind, min_lr_ratio=0.1)
    expected = _torch_rates(kind, 2e-4, 5, 40, 0.1)
    ours = [lr_at(step, config) for step in range(40)]
    assert ours == pytest.approx(expected, rel=1e-6), max(abs(a - b) for a, b in zip(ours, expected, strict=True))
    # The LambdaLR train() hands apply_plan moves the optimizer through the same rates.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    scheduler = lr_scheduler(lambda: config)(optimizer)
    seen = []
    for _ in range(40):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(expected, rel=1e-6)
    if kind == "constant":
        assert set(ours[5:]) == {2e-4}
    else:
        assert ours[-1] < 2e-4 * 0.15 and ours[5] == pytest.approx(2e-4)


def test_the_peak_rate_is_chosen_for_pre_training_full_fine_tuning_and_lora(hf_model_dir):
    transformers = pytest.importorskip("transformers")
    from memtrain.hf import apply_lora, load_pretrained

    assert default_lr(tiny_gpt())[0] == PRETRAINING_LR
    random_llama = transformers.LlamaForCausalLM(tiny_llama_config())  # --hf-config: random weights
    assert default_lr(random_llama)[0] == PRETRAINING_LR
    pretrained = load_pretrained(hf_model_dir)
    lr, why = default_lr(pretrained)
    assert lr == FULL_FINETUNING_LR == 2e-5 and "fine-tuning a pretrained model" in why and str(hf_model_dir) in why
    lr, why = default_lr(apply_lora(pretrained, 4))
    assert lr == LORA_LR == 2e-4 and "LoRA" in why
    assert default_lr(apply_lora(tiny_gpt(), 4))[0] == PRETRAINING_LR  # adapters on random weights


def test_the_schedule_is_resolved_with_its_reasons_and_an_explicit_lr_wins(hf_model_dir):
    pytest.importorskip("transformers")
    from memtrain.hf import load_pretrained

    model = load_pretrained(hf_model_dir)
    config, reasons, auto = resolve_schedule(TrainConfig(max_steps=100), model, examples=1000, global_batch=16)
    assert (config.lr, config.warmup_steps, auto) == (2e-5, 3, {"lr": True, "warmup_steps": True})
    assert reasons[0].startswith("lr 2e-05, because: fine-tuning a pretrained model")
    assert "after 3 warm-up steps, cosine to 2e-06 at step 100" in reasons[1] and "3% of max_steps" in reasons[1]
    config, reasons, auto = resolve_schedule(TrainConfig(lr=1e-3, epochs=2, lr_schedule="constant"), tiny_gpt(),
                                             examples=1000, global_batch=16)
    assert (config.lr, config.max_steps, config.warmup_steps) == (1e-3, 125, 12)
    assert auto == {"lr": False, "warmup_steps": True}
    assert reasons[0] == ("max_steps 125, because: 2 epoch(s) of 1000 examples at a global batch of 16 = "
                          "ceil(2 x 1000 / 16) (--epochs)")
    assert reasons[1] == "lr 0.001, because: given (--lr)" and "constant to step 125" in reasons[2]
    with pytest.raises(ConfigError, match="warmup_steps=20 is more than the 2 steps of epochs=1"):
        resolve_schedule(TrainConfig(epochs=1, warmup_steps=20), tiny_gpt(), examples=20, global_batch=16)


def test_epochs_count_the_steps_that_pass_over_the_data():
    assert steps_for_epochs(1, 1000, 16) == 63  # the 63rd step completes its batch from the next pass
    assert steps_for_epochs(3, 64, 16) == 12
    with pytest.raises(ConfigError, match="max_steps=10 and epochs=2 both set the run's length"):
        TrainConfig(max_steps=10, epochs=2).validate()


def test_betas_and_eps_reach_every_optimizer_apply_plan_builds():
    base = PlanSettings(micro_batch_size=2, accumulation=1, blocks=("keep",) * 2, flavor="full", chunked_loss=False,
                        optimizer="device", distribution="none", compile=False, precision="fp32")
    set_ups = {
        "fused AdamW": base,
        "ComposedOptimizer (bf16 moments)": replace(base, state_precision="bf16"),
        "ComposedOptimizer (step in backward)": replace(base, step_in_backward=True),
        "ComposedOptimizer (partly offloaded)": replace(base, offload_fraction=0.5),
        "CPUOffloadOptimizer": replace(base, optimizer="offload"),
        "CPUOffloadOptimizer (bf16 weights)": replace(base, optimizer="offload-bf16-weights", precision="bf16-mixed"),
    }
    for name, settings in set_ups.items():
        run = apply_plan(tiny_gpt(seed=0), settings, lr=1e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)
        groups = run.optimizer.param_groups
        inner = getattr(run.optimizer, "optimizer", None)  # the host optimizer CPUOffloadOptimizer wraps
        for group in [*groups, *(inner.param_groups if isinstance(inner, torch.optim.Optimizer) else [])]:
            assert (tuple(group["betas"]), group["eps"]) == ((0.8, 0.99), 1e-6), (name, group["betas"], group["eps"])
        if hasattr(run.optimizer, "close"):
            run.optimizer.close()


@pytest.mark.parametrize(("bad", "message"), [
    ({"lr_schedule": "step"}, "lr_schedule='step' is not one of cosine, linear, constant"),
    ({"adam_betas": (0.9, 1.0)}, "adam_betas=(0.9, 1.0) must be two numbers in [0, 1)"),
    ({"adam_betas": (0.9,)}, "adam_betas=(0.9,) must be two numbers"),
    ({"adam_eps": 0.0}, "adam_eps=0.0 must be a number > 0"),
    ({"epochs": 0}, "epochs=0 must be an integer >= 1"),
    ({"lr": -1.0}, "lr=-1.0 must be a positive number"),
])
def test_bad_schedule_and_optimizer_settings_are_refused_naming_the_field(bad, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        TrainConfig(**bad).validate()


def test_a_resumed_run_logs_the_schedule_it_continues_on(tmp_path, capsys):
    from helpers import code_windows, quick_run_config

    from memtrain import train

    out = tmp_path / "run"
    train(tiny_gpt(seq_len=32, seed=0), code_windows(), quick_run_config(out, max_steps=10))  # warm-up: 1 step
    capsys.readouterr()
    # Ten times longer: a new run would warm up over 10 steps; the resumed one keeps its own 1, at step 10.
    train(tiny_gpt(seq_len=32, seed=0), code_windows(), quick_run_config(out, max_steps=100, resume=True))
    lines = [line.strip() for line in capsys.readouterr().err.splitlines() if line.strip().startswith("learning rate")]
    expected = lr_at(10, TrainConfig(lr=1e-2, warmup_steps=1, max_steps=100))  # quick_run_config's lr
    assert lines == [f"learning rate {expected:.3g} at step 10, where the run resumes (peak 0.01; its 1 warm-up steps "
                     "done), cosine to 0.001 at step 100 (--lr-schedule cosine) (the run's own warm-up and peak)"], lines
