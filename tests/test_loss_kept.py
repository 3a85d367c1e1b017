"""A chunked loss that skips what it ignores: given ``kept`` (the labels that are not -100, counted on the host), only
those positions reach the head, so a prompt or padding costs no matmul, no logits and no saved hidden state; the loss
and gradients are the plain loss's within float rounding, and gathering the positions reads nothing back from the
device (``torch.nonzero_static`` of the host's count). The training loop counts each batch's labels before its copy
to the device and passes the count to the loss."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from helpers import code_windows, quick_run_config, tiny_gpt
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from memtrain import train
from memtrain.choices import Choices
from memtrain.errors import ConfigError
from memtrain.loss import apply_chunked_loss, chunked_cross_entropy, language_model_loss
from memtrain.measure import count_host_syncs

TOKENS, HIDDEN, VOCAB = 96, 16, 50
KERNELS = ["memtrain"] + (["torch"] if hasattr(F, "linear_cross_entropy") else [])


def _prompted(prompt_share: float = 0.5, seed: int = 0) -> tuple[torch.Tensor, nn.Linear, torch.Tensor, int]:
    """Hidden states, a head with a bias, and labels whose first ``prompt_share`` of each 16-token row is a prompt
    (-100), with the host's count of the labels that count."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float64).float().requires_grad_()
    torch.manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[torch.arange(TOKENS) % 16 < int(prompt_share * 16)] = -100
    return hidden, head, labels, int((labels != -100).sum())


class MatmulFlops(TorchDispatchMode):
    """The FLOPs of every op torch's flop counter knows (matmuls), counted as they dispatch; unlike
    ``FlopCounterMode`` it tracks no module, so a head called again in backward is counted as any op."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def _loss_and_grads(hidden, head, fn):
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None
    loss = fn()
    loss.backward()
    return loss.detach(), hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("share", [0.5, 0.25, 0.0])
def test_skipping_the_ignored_positions_keeps_the_loss_and_gradients(implementation, share):
    """fp32: the loss within 1e-6 (relative) of the whole-logits loss, every gradient within 1e-6 of its largest
    entry; the prompt's rows of the hidden states' gradient are exactly zero."""
    hidden, head, labels, kept = _prompted(share)
    want = _loss_and_grads(hidden, head, lambda: F.cross_entropy(head(hidden).float(), labels, reduction="sum"))
    got = _loss_and_grads(hidden, head, lambda: chunked_cross_entropy(
        hidden, head, labels, chunk_tokens=20, implementation=implementation, kept=kept))
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0]), (got[0], want[0])
    for g, w in zip(got[1:], want[1:], strict=True):
        assert (g - w).abs().max() <= 1e-6 * w.abs().max(), (g - w).abs().max()
    assert torch.equal(got[1][labels == -100], torch.zeros_like(got[1][labels == -100]))


def test_half_the_positions_prompt_halves_the_heads_flops():
    """memtrain's kernel, counted forward and backward: the head's matmuls run over the kept positions only (every
    FLOP of the loss is the head's)."""
    hidden, head, labels, kept = _prompted(0.5)
    assert kept == TOKENS // 2

    def flops(**kept_arg):
        with MatmulFlops() as counter:
            chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, implementation="memtrain",
                                  **kept_arg).backward()
        return counter.flops

    every, skipped = flops(), flops(kept=kept)
    assert every > 0 and skipped * 2 == every, (skipped, every)


@pytest.mark.skipif("torch" not in KERNELS, reason="torch < 2.13 has no F.linear_cross_entropy")
def test_torchs_op_is_given_the_kept_positions_only(monkeypatch):
    """torch's fused op dispatches as one op (no matmul to count): the rows it is given are the kept ones."""
    hidden, head, labels, kept = _prompted(0.5)
    real, rows = F.linear_cross_entropy, []

    def recorded(input, weight, target, **kwargs):
        rows.append((input.shape[0], int((target == -100).sum())))
        return real(input, weight, target, **kwargs)

    monkeypatch.setattr(F, "linear_cross_entropy", recorded)
    chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, implementation="torch", kept=kept).backward()
    chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, implementation="torch").backward()
    assert rows == [(kept, 0), (TOKENS, TOKENS - kept)], rows


def test_the_positions_are_gathered_without_reading_the_device():
    """No ``nonzero``, ``item`` or other host read in the loss's forward or backward: the count is the host's."""
    hidden, head, labels, kept = _prompted(0.5)
    with count_host_syncs() as syncs:
        chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, implementation="memtrain", kept=kept).backward()
    assert syncs.calls == [], syncs.calls


def test_a_batch_of_prompts_only_is_a_zero_loss_backward_runs_through():
    hidden, head, labels, kept = _prompted(1.0)
    assert kept == 0
    loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, kept=0)
    loss.backward()
    assert loss.item() == 0 and not hidden.grad.any()


@pytest.mark.parametrize("kept", [-1, TOKENS + 1, 1.5, True, "48"])
def test_a_count_that_is_not_one_is_refused_naming_the_fix(kept):
    hidden, head, labels, _ = _prompted(0.5)
    with pytest.raises(ConfigError, match=r"must be the number of labels that are not ignore_index, in \[0, 96\]"):
        chunked_cross_entropy(hidden, head, labels, kept=kept)


def test_the_models_losses_take_the_count():
    """memtrain's GPT and a Hugging Face causal LM: ``language_model_loss(..., kept=)`` equals the loss without it,
    and the count never reaches the Hugging Face model's own forward (under no_grad its own forward runs)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt = tiny_gpt(2, seq_len=16, seed=0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32))
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, :6] = -100
    kept = int((y != -100).sum())
    for model in (gpt, llama):
        apply_chunked_loss(model, chunk_tokens=8)
        plain, counted = language_model_loss(model, x, y), language_model_loss(model, x, y, kept=kept)
        assert torch.allclose(plain, counted, rtol=1e-6), (type(model).__name__, plain, counted)
        with torch.no_grad():
            language_model_loss(model, x, y, kept=kept)


def test_the_training_loop_passes_each_micro_batchs_count(tmp_path, monkeypatch):
    """The loop's batches carry the host's count of their labels; each micro-batch's loss gets its own."""
    step = importlib.import_module("memtrain.run.step")
    real, seen = step.language_model_loss, []

    def recorded(model, x, y, positions=None, **kwargs):
        seen.append((kwargs.get("kept"), int((y != -100).sum())))
        return real(model, x, y, positions, **kwargs)

    monkeypatch.setattr(step, "language_model_loss", recorded)
    config = quick_run_config(tmp_path, max_steps=2, global_batch_size=4, micro_batch_size=2,
                              choices=Choices(chunked_loss=True, checkpointing="none"))
    assert train(tiny_gpt(2, seq_len=32, seed=0), code_windows(32), config).steps == 2
    assert len(seen) == 4 and all(kept == count for kept, count in seen), seen


def test_the_estimate_follows_the_kept_positions_of_a_dict_batchs_labels():
    """A dict batch whose labels mask the prompt (-100): with the chunked loss the estimate passes the count the loop
    passes, so the loss's saved bytes are those of the kept positions, equal to a measurement of that call; with
    every label kept, more."""
    from test_loss import hf_model

    from memtrain import estimate
    from memtrain.checkpointing import apply_checkpointing
    from memtrain.loss import KEPT_ARGUMENT
    from memtrain.measure import MemoryMeter

    model = hf_model("llama", vocab=512)
    x = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    labels = x.clone()
    labels[:, :24] = -100  # the prompt: half of each row
    kept = int((labels[:, 1:] != -100).sum())
    apply_checkpointing(model)
    apply_chunked_loss(model, chunk_tokens=16)
    with MemoryMeter(model) as meter:
        loss = model(input_ids=x, labels=labels, **{KEPT_ARGUMENT: kept}).loss
    loss.backward()
    setup = Choices(chunked_loss=True)
    prompted = estimate(model, {"input_ids": x, "labels": labels}, device="cpu", checkpointing="all", setup=setup)
    whole = estimate(model, {"input_ids": x, "labels": x.clone()}, device="cpu", checkpointing="all", setup=setup)
    assert prompted.activation_bytes == meter.activation_bytes, (prompted.activation_bytes, meter.activation_bytes)
    assert prompted.activation_bytes < whole.activation_bytes  # the kept positions' gathered hidden states


def test_the_plans_loss_time_follows_the_share_of_labels_that_count():
    """``plan(kept_share=)``: the chunked loss's head and logits are timed on that share of the positions, linearly
    (a profile whose host adds its per-op cost to the work, so that seconds add up); the whole-logits loss and a
    compiled step, which run every position, are timed as before; the peak is a batch whose every label counts."""
    import dataclasses

    from helpers import h100, planner_llama

    from memtrain.planner import plan

    model = planner_llama(layers=2, hidden=256)
    common = dict(budget=None, seq_len=256, global_batch_size=4, device="cuda", micro_batch_size=4,
                  device_profile=dataclasses.replace(h100(), asynchronous=False))
    chunked = plan(model, **common, choices=Choices(chunked_loss=True, checkpointing="none")).settings

    def at(share, settings):
        return plan(model, **common, settings=settings, kept_share=share)

    every, three_quarters, half = at(1.0, chunked), at(0.75, chunked), at(0.5, chunked)
    saved = every.step_seconds - half.step_seconds
    assert saved > 0 and saved == pytest.approx(2 * (every.step_seconds - three_quarters.step_seconds), rel=1e-9)
    assert half.peak_bytes == every.peak_bytes
    assert any("the loss counts 50% of the label positions" in a for a in half.assumptions), half.assumptions
    assert not any("label positions" in a for a in every.assumptions)
    for runs_every_position in (dataclasses.replace(chunked, chunked_loss=False),
                                dataclasses.replace(chunked, compile=True)):
        assert at(0.5, runs_every_position).step_seconds == at(1.0, runs_every_position).step_seconds


def test_the_last_norm_is_timed_on_every_position(monkeypatch):
    """The loss skips positions after the last norm has run on all of them: the norm's forward and backward (the
    tail's runs before the head's matmul, of a module of the model) are timed whole, the head and logits on the
    share. Before, the norm's work was scaled with the head's, so the plan saved more than the loss does."""
    import dataclasses

    from helpers import h100, planner_llama

    import memtrain.planner.profiles as profiles
    from memtrain.estimate import trace
    from memtrain.models import GPT, GPT_PRESETS
    from memtrain.planner import plan

    for model, norm, seq in ((planner_llama(layers=2, hidden=256), "model.norm", 256),
                             (GPT(GPT_PRESETS["gpt-tiny"]), "ln_f", 64)):
        t = trace(model, device="cuda", precision="bf16-mixed", chunked_loss=True, micro_batch_size=1, seq_len=seq,
                  runs=True)
        forward, backward = profiles._every_position(profiles._segments(t))
        assert [r.label for r in forward] == [norm] and [r.label for r in backward] == [norm]

    model = planner_llama(layers=2, hidden=256)
    common = dict(budget=None, seq_len=256, global_batch_size=4, device="cuda", micro_batch_size=4,
                  device_profile=dataclasses.replace(h100(), asynchronous=False))
    chunked = plan(model, **common, choices=Choices(chunked_loss=True, checkpointing="none")).settings

    def saved():
        return (plan(model, **common, settings=chunked, kept_share=1.0).step_seconds
                - plan(model, **common, settings=chunked, kept_share=0.5).step_seconds)

    norm_kept = saved()
    monkeypatch.setattr(profiles, "_every_position", lambda s: ([], []))  # the norm scaled with the head
    assert 0 < norm_kept < saved()


@pytest.mark.parametrize("share", [0, 1.5, -0.5, True, "0.5"])
def test_a_kept_share_that_is_no_fraction_is_refused_naming_it(share):
    from helpers import planner_llama

    from memtrain.planner import plan

    with pytest.raises(ConfigError, match=r"kept_share=.* must be a fraction in \(0, 1\]"):
        plan(planner_llama(layers=2, hidden=256), budget=None, seq_len=64, global_batch_size=2, kept_share=share)


def test_memtrain_plan_takes_the_kept_share_and_refuses_one_out_of_range(capsys):
    from memtrain.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "gpt-tiny", "--seq-len", "64", "--kept-labels", "0"])
    assert exited.value.code == 2 and "must be a fraction in (0, 1]" in capsys.readouterr().err
    main(["plan", "--model", "gpt-tiny", "--seq-len", "64", "--global-batch-size", "2", "--kept-labels", "0.25",
          "--no-progress"])
    assert "the loss counts 25% of the label positions" in capsys.readouterr().out


def test_training_reads_the_kept_share_from_its_data_and_plans_with_it(tmp_path, monkeypatch):
    """``memtrain.run.step.kept_share``: the share of a dataset's labels that are not -100 (its rows spread over
    it); train passes it to every plan of the run."""
    from memtrain.run import replan
    from memtrain.run.step import kept_share

    windows = code_windows(32)[0]
    prompted = [(x, torch.where(torch.arange(len(y)) < 24, -100, y)) for x, y in (windows[i] for i in range(64))]
    assert kept_share(prompted) == 0.25
    assert kept_share([(torch.zeros(4), torch.full((4,), -100))]) == 1.0  # nothing counts: nothing to follow
    read = []

    class Rows(list):
        def __getitem__(self, i):
            read.append(i)
            return super().__getitem__(i)

    assert kept_share(Rows(prompted * 8), rows=256) == 0.25 and len(read) == 256  # 512 rows: every other one
    real, shares = replan.plan, []

    def recorded(*args, **kwargs):
        shares.append(kwargs["kept_share"])
        return real(*args, **kwargs)

    monkeypatch.setattr(replan, "plan", recorded)
    config = quick_run_config(tmp_path, max_steps=1, global_batch_size=4, micro_batch_size=2, budget="1GiB",
                              choices=Choices(chunked_loss=True, checkpointing="none"))
    train(tiny_gpt(2, seq_len=32, seed=0), prompted, config)
    assert shares and all(s == 0.25 for s in shares), shares
