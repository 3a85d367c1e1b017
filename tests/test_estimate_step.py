"""estimate's step on the CPU: the saved-activation bytes equal measure's, checkpointing orders the peaks, only
the loss outlives forward, and a forward that cannot run on fake tensors names its module."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama_config
from torch import nn

from memtrain import apply_checkpointing, measure, remove_checkpointing
from memtrain.errors import MemtrainError
from memtrain.estimate import estimate
from memtrain.models import GPT, GPT_PRESETS

transformers = pytest.importorskip("transformers")

B, T = 2, 32
V = 256
POLICIES = {"none": None, "all": {"every": 1}, "every:2": {"every": 2}}


def _gpt2_config():
    return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=64,
                                   bos_token_id=0, eos_token_id=0)


def _models():
    torch.manual_seed(0)
    return {
        "gpt": GPT(GPT_PRESETS["gpt-tiny"]),
        "llama": transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=V, max_position_embeddings=128)),
        "gpt2": transformers.GPT2LMHeadModel(_gpt2_config()),
    }


def _step(name, model, x):
    labels = x.clone()  # a training batch's labels are their own tensor
    if name == "gpt":
        return lambda: model(x, labels)
    return lambda: model(input_ids=x, labels=labels)


@pytest.fixture(scope="module")
def models():
    return _models()


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2"])
def test_saved_bytes_match_measure_on_cpu(models, name, policy):
    model = models[name]
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    if POLICIES[policy]:
        apply_checkpointing(model, **POLICIES[policy])
    try:
        measured = measure(_step(name, model, x), model=model)
    finally:
        remove_checkpointing(model)
        model.zero_grad(set_to_none=True)
    estimated = estimate(model, x, device="cpu", checkpointing=policy)
    error = estimated.activation_bytes / measured.activation_bytes - 1
    assert abs(error) <= 0.05, (
        f"{name} checkpointing={policy}: estimated {estimated.activation_bytes} saved bytes, measured "
        f"{measured.activation_bytes} ({100 * error:+.2f}%)"
    )
    assert estimated.gradient_bytes == measured.gradient_bytes
    assert estimated.source == "estimated" and estimated.peak_bytes is not None
    # The model handed in is left alone: real parameters, no checkpoint wrapping, no gradients.
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert "forward" not in model.__dict__


def test_checkpointing_policies_order_saved_bytes_and_peaks():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    reports = {p: estimate(model, (8, 64), device="cpu", checkpointing=p) for p in POLICIES}
    saved = {p: r.activation_bytes for p, r in reports.items()}
    peaks = {p: r.peak_bytes for p, r in reports.items()}
    assert saved["all"] < saved["every:2"] < saved["none"], saved
    assert peaks["all"] < peaks["none"], peaks


def test_cpu_autocast_bf16():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    x = torch.randint(0, V, (4, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = measure(lambda: model(x, x.clone()), model=model)
    estimated = estimate(model, x, device="cpu", precision="bf16-mixed")
    assert estimated.activation_bytes == measured.activation_bytes, (estimated.activation_bytes,
                                                                       measured.activation_bytes)


class _ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 0:  # reads a value: impossible without data
            return self.proj(x)
        return self.proj(-x)


def test_forward_that_reads_values_names_the_module():
    model = nn.Sequential(nn.Linear(8, 8), _ReadsValues())
    with pytest.raises(MemtrainError) as info:
        estimate(model, torch.zeros(2, 8), device="cpu")
    message = str(info.value)
    assert "'1'" in message and "To resolve this error" in message, message


def _fake_embedding_checks_the_ids() -> bool:
    """Whether this torch's shape-only embedding refuses float ids, as the real one does (torch 2.13's does; torch
    2.11's returns embeddings, and the float ids fail later, where the loss gathers by them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        try:
            torch.nn.functional.embedding(torch.zeros(2), torch.zeros(4, 3))
        except RuntimeError:
            return True
    return False


def test_batch_that_does_not_fit_the_model_is_a_clear_error():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    where = "'wte'" if _fake_embedding_checks_the_ids() else "'GPT'"  # the module whose forward failed
    with pytest.raises(MemtrainError, match=f"the forward of {where} failed") as info:
        estimate(model, torch.zeros(2, 16), device="cpu")  # float "tokens" into an embedding
    assert "the batch does not fit the model" in str(info.value) and "To resolve this error" in str(info.value)


def test_only_the_loss_outlives_forward_unless_the_output_is_kept():
    """memtrain's loop keeps the loss, not the output: the logits (here fp32: no autocast) die after forward. A loop
    holding ``out`` until backward keeps them alive at the backward's peak, on top."""
    config = tiny_llama_config(max_position_embeddings=128, vocab_size=8192)
    b, t = 4, 64
    logits = b * t * 8192 * 4
    dropped = estimate(config, (b, t), device="cpu", checkpointing="all")
    kept = estimate(config, (b, t), device="cpu", checkpointing="all", keep_output=True)
    assert kept.peak_bytes - dropped.peak_bytes == logits, (kept.peak_bytes - dropped.peak_bytes, logits)
    assert kept.activation_bytes == dropped.activation_bytes


def _packed_batch(rows: int, documents: tuple[int, ...]):
    """Rows of ``sum(documents)`` positions, several documents each (``position_ids`` restart at each), prompts
    masked in the labels: the three tensors memtrain's loop passes for ``memtrain.data.PackedRows``."""
    x = torch.randint(0, V, (rows, sum(documents)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in documents]).repeat(rows, 1)
    labels = x.clone()
    labels[:, :3] = -100  # a prompt's tokens carry no loss
    return x, labels, positions


@pytest.mark.parametrize("documents", [(20, 12), (T,)], ids=["packed", "one-document-rows"])
def test_packed_rows_saved_bytes_match_the_loops_step(documents):
    """The batch memtrain's loop passes for packed rows (labels with -100, restarting position_ids): the model
    builds a block-diagonal mask, and the estimate (tensors, or shapes taken as packed) counts what the step saves."""
    from memtrain.loss import language_model_loss

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=V, max_position_embeddings=128))
    model.config.use_cache = False  # as memtrain trains (with a KV cache transformers does not look for packing)
    x, labels, positions = _packed_batch(B, documents)
    measured = measure(lambda: language_model_loss(model, x, labels, positions), model=model)
    model.zero_grad(set_to_none=True)
    given = estimate(model, {"input_ids": x, "labels": labels, "position_ids": positions}, device="cpu")
    assert given.activation_bytes == measured.activation_bytes, (given.activation_bytes, measured.activation_bytes)
    unpacked = estimate(model, (B, T), device="cpu").activation_bytes
    as_shapes = estimate(model, dict.fromkeys(("input_ids", "labels", "position_ids"), (B, T)), device="cpu")
    if len(documents) > 1:  # the mask costs bytes the token-only estimate missed
        assert as_shapes.activation_bytes == measured.activation_bytes > unpacked, (as_shapes, unpacked)
    else:  # positions 0..T-1 in every row: the values say unpacked (no mask), as transformers decides on them
        assert given.activation_bytes < as_shapes.activation_bytes, (given, as_shapes)


@pytest.mark.parametrize("padding", [0, 12], ids=["all-ones", "padded"])
def test_attention_mask_saved_bytes_match_measure(padding):
    """A padded batch's mask is kept (a mask in every attention), an all-ones one left out, as transformers does on
    the values; a mask given as a shape is taken to pad. It used to fail: transformers reads the mask's values."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=V, max_position_embeddings=128))
    model.config.use_cache = False  # as memtrain trains
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - padding:] = 0
    measured = measure(lambda: model(input_ids=x, attention_mask=mask, labels=x.clone()), model=model)
    model.zero_grad(set_to_none=True)
    given = estimate(model, {"input_ids": x, "attention_mask": mask}, device="cpu")
    assert given.activation_bytes == measured.activation_bytes, (given.activation_bytes, measured.activation_bytes)
    as_shapes = estimate(model, {"input_ids": (B, T), "attention_mask": (B, T)}, device="cpu").activation_bytes
    assert as_shapes >= given.activation_bytes and (as_shapes == given.activation_bytes) == bool(padding)


class _TwoOutputs(nn.Module):
    """A plain module returning a tuple (a tensor first), as many non-Hugging-Face models do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.a(x).relu()
        return self.b(h), h.mean()


def _bert():
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=V, max_position_embeddings=64)
    return transformers.BertModel(config)  # a base model: its output (last_hidden_state, pooler_output) has no loss


@pytest.mark.parametrize("build, batch", [
    (_bert, lambda: torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))),
    (_TwoOutputs, lambda: torch.randn(B, T, 32)),
    (lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)), lambda: torch.randn(B, T, 32)),
], ids=["BertModel", "tuple", "tensor"])
def test_outputs_without_a_loss_stand_for_it_by_their_first_tensors_sum(build, batch):
    """estimate (and measure) take the sum of the first output tensor as the loss: the same saved bytes as the
    step measured. BertModel's output used to fail with a message about an ``fn`` the caller never passed."""
    torch.manual_seed(0)
    model, x = build(), batch()
    measured = measure(model, x)
    model.zero_grad(set_to_none=True)
    r = estimate(model, x, device="cpu")
    assert (r.activation_bytes, r.gradient_bytes) == (measured.activation_bytes, measured.gradient_bytes), (
        r.activation_bytes, measured.activation_bytes, r.gradient_bytes, measured.gradient_bytes)


def test_an_output_without_any_tensor_is_one_line_naming_estimate():
    class Nothing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.lin(x)
            return {"note": "no tensor"}

    with pytest.raises(MemtrainError) as info:
        estimate(Nothing(), torch.zeros(2, 4), device="cpu")
    message = str(info.value)
    assert "estimate: the forward of Nothing returned dict" in message and "fn" not in message.split(), message
    assert "\n" not in message and "To resolve this error" in message, message
