"""Chunked cross-entropy: the same loss and gradients as the whole-logits loss, for a fraction of the saved bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memtrain import ConfigError, MemoryMeter, apply_checkpointing
from memtrain.choices import Choices
from memtrain.logit_steps import Unrecognised, logit_steps
from memtrain.loss import (
    LogitsHead,
    LogitTransform,
    apply_chunked_loss,
    chunked_cross_entropy,
    chunked_loss_implementation,
    chunked_loss_kind,
    language_model_loss,
    logit_transform,
    output_head,
    remove_chunked_loss,
    supports_chunked_loss,
)
from memtrain.measure import cpu_allocation_peak_bytes
from memtrain.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

# torch's chunked kernel (F.linear_cross_entropy) is torch >= 2.13's; on older torch only memtrain's kernel runs.
TORCHS_OP = hasattr(F, "linear_cross_entropy") and hasattr(nn, "LinearCrossEntropyOptions")
TORCH_KERNEL = pytest.param("torch", marks=pytest.mark.skipif(
    not TORCHS_OP, reason=f"torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13 has)"))

# fp32 on CPU: chunking changes only the order of the sums. Gradients are compared within 1e-5 of their
# largest entry (a summed loss's gradients reach 10 and more, so float rounding there is ~1e-6 in absolute terms).
TOL = dict(rtol=1e-5, atol=1e-6)


# The models that transform their logits (memtrain.logit_steps), with values that change the loss: the softcap at 2 and
# weights initialised at std 0.5 (logits of a few units: tanh is far from linear there), scales of 4x.
_SOFTCAPPED = {"final_logit_softcapping": 2.0, "head_dim": 8, "sliding_window": 8}
TRANSFORMED = {"gemma2": ("Gemma2Config", _SOFTCAPPED), "gemma3_text": ("Gemma3TextConfig", _SOFTCAPPED),
               "vaultgemma": ("VaultGemmaConfig", _SOFTCAPPED),
               "nanochat": ("NanoChatConfig", {"final_logit_softcapping": 2.0}),
               "cohere": ("CohereConfig", {"logit_scale": 0.25}),
               "cohere2": ("Cohere2Config", {"logit_scale": 0.25, "sliding_window": 8}),
               "granite": ("GraniteConfig", {"logits_scaling": 4.0}),
               "hyperclovax": ("HyperCLOVAXConfig", {"logits_scaling": 0.25})}
# And some whose forward is Llama's, logits untouched: Gemma-1 (its decoder scales the embeddings), Phi-3 (fused
# projections), OLMo-2 (norms after the attention), StarCoder2 (biases, a plain MLP), GLM.
PLAIN = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
         "gemma": "GemmaConfig", "phi3": "Phi3Config", "olmo2": "Olmo2Config", "starcoder2": "Starcoder2Config",
         "glm": "GlmConfig"}
KINDS = sorted({"gpt2", *TRANSFORMED, *PLAIN})


def hf_model(kind: str, *, layers: int = 2, hidden: int = 32, intermediate: int = 64, vocab: int = 128,
             positions: int = 64) -> nn.Module:
    torch.manual_seed(0)
    size = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=positions)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab,
                                         n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
    elif kind in TRANSFORMED:
        name, transform = TRANSFORMED[kind]
        config = getattr(transformers, name)(**size, **transform, initializer_range=0.5, bos_token_id=0,
                                             eos_token_id=0, pad_token_id=0)
    else:
        config = getattr(transformers, PLAIN[kind])(**size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager" if "gemma" in kind else "sdpa"  # Gemma-2's attention has no sdpa
    config.use_cache = False
    return transformers.AutoModelForCausalLM.from_config(config).train()


def loss_and_grads(model: nn.Module, call) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = call(model)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want) -> None:
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 10_000])
def test_chunked_cross_entropy_equals_the_whole_logits_loss(chunk_tokens):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 21, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 21))
    labels[0, :5] = -100

    def grads(loss):
        return loss.detach(), torch.autograd.grad(loss, (hidden, head.weight))

    want = grads(F.cross_entropy(head(hidden).float().flatten(0, 1), labels.flatten(), reduction="sum"))
    got = grads(chunked_cross_entropy(hidden, head, labels, chunk_tokens=chunk_tokens))
    torch.testing.assert_close(got[0], want[0], **TOL)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("implementation", ["memtrain", TORCH_KERNEL])
def test_only_the_hidden_states_are_saved(implementation):
    """memtrain's kernel saves the hidden states and labels; torch's saves nothing through saved_tensors_hooks
    (it holds the gradients it computed in forward instead, which the hooks cannot see)."""
    torch.manual_seed(0)
    head = nn.Linear(16, 1000, bias=False)
    hidden = torch.randn(4, 32, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (4, 32))
    for chunked in (False, True):
        with MemoryMeter(head) as meter:
            if chunked:
                loss = chunked_cross_entropy(hidden * 1, head, labels, chunk_tokens=16, implementation=implementation)
            else:
                loss = F.cross_entropy(head(hidden * 1).float().flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
        if chunked and implementation == "memtrain":
            # the hidden states and the labels, once each (every chunk's input is a view of them)
            assert meter.activation_bytes == hidden.numel() * 4 + labels.numel() * 8
        elif chunked:
            assert meter.activation_bytes == 0
        else:  # the hidden states plus the (tokens x vocabulary) fp32 log-softmax
            assert meter.activation_bytes >= hidden.numel() * 4 + 4 * 32 * 1000 * 4


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_gpt_with_a_chunked_loss_gives_the_same_loss_and_gradients(reduction):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, dropout=0.1))
    x = torch.randint(0, 256, (3, 32))
    y = torch.roll(x, -1, dims=1)
    y[1, 20:] = -100

    def call(m):
        torch.manual_seed(1)  # the same dropout masks in both runs
        return m(x, y, reduction=reduction)

    want = loss_and_grads(model, call)
    apply_checkpointing(model)
    apply_chunked_loss(model, chunk_tokens=10)
    assert_same(loss_and_grads(model, call), want)
    assert remove_chunked_loss(model) and model.loss_chunk_tokens is None and not remove_chunked_loss(model)


def test_without_gradients_the_model_runs_its_own_forward(monkeypatch):
    """Evaluation and generation need no chunks: under no_grad the whole-logits path runs (chunking would fail)."""
    import memtrain.loss

    def no_chunks(*args, **kwargs):
        raise AssertionError("chunked_cross_entropy ran under no_grad")

    monkeypatch.setattr(memtrain.loss, "chunked_cross_entropy", no_chunks)
    torch.manual_seed(0)
    gpt, llama = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=16)), hf_model("llama")
    apply_chunked_loss(gpt)
    apply_chunked_loss(llama)
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert gpt(x, x, reduction="sum").ndim == 0 and gpt.generate(x[:1, :4], 3).shape == (1, 7)
        out = llama(x, labels=x)
        assert out.logits.shape == (2, 16, 128) and out.loss.ndim == 0
    with pytest.raises(AssertionError, match="under no_grad"):  # with gradients on, the chunks do run
        gpt(x, x)


@pytest.mark.parametrize("kind", KINDS)
def test_hugging_face_models_with_a_chunked_loss_give_the_same_loss_and_gradients(kind):
    model = hf_model(kind)
    input_ids = torch.randint(0, 128, (2, 24))
    labels = input_ids.clone()
    labels[0, 10:] = -100
    plain_forward = model.forward

    def call(m):
        return m(input_ids, labels=labels).loss

    def call_with_items(m):  # the Trainer's token-count-correct form
        return m(input_ids=input_ids, labels=labels, num_items_in_batch=torch.tensor(30)).loss

    want, want_items = loss_and_grads(model, call), loss_and_grads(model, call_with_items)
    apply_checkpointing(model)
    apply_chunked_loss(model, chunk_tokens=5)
    assert_same(loss_and_grads(model, call), want)
    assert_same(loss_and_grads(model, call_with_items), want_items)
    assert model(input_ids, labels=labels).logits is None  # not holding them is the point
    assert model(input_ids).logits.shape == (2, 24, 128)  # no labels: the model's own forward
    with torch.no_grad():
        assert model(input_ids, labels=labels).logits is not None  # evaluation: the model's own forward
    assert remove_chunked_loss(model) and model.forward == plain_forward


# -- models that scale or soft-cap their logits (Gemma-2/3, Cohere, Granite, ...) --------------------------------
def test_every_step_on_the_logits_that_a_transformers_model_takes_is_tested():
    """Every (op, attribute) ``logit_steps`` reads from a causal LM of the installed transformers is one a type of
    TRANSFORMED takes, so the parity tests below cover every transform memtrain applies."""
    tested = {step for kind in TRANSFORMED for step in logit_steps(type(hf_model(kind)))}
    found = {step for cls in _causal_lm_classes() if not isinstance(steps := logit_steps(cls), Unrecognised)
             for step in steps}
    assert found <= tested, found - tested


def _causal_lm_classes() -> list[type]:
    out = []
    for name in dir(transformers):
        if name.endswith(("ForCausalLM", "LMHeadModel")) and not name.startswith(("Auto", "TF", "Flax")):
            try:
                cls = getattr(transformers, name)
            except (ImportError, AttributeError):  # a model whose extra is not installed
                continue
            if isinstance(cls, type) and hasattr(cls, "forward"):
                out.append(cls)
    return out


def test_the_steps_are_read_from_each_forward_as_memtrain_checked_them_by_hand():
    """What transformers 5.25's forwards do between the head and the loss, read by hand (the table memtrain kept
    before it read them): ``logit_steps`` finds the same, from the source of each forward (a decorated forward
    too), and finds Gemma-1's, Phi-3's and OLMo-2's forwards Llama's. The loss's arguments may be spelled either
    way (Gemma-2 passes them by position)."""
    by_hand = {"llama": (), "mistral": (), "qwen2": (), "qwen3": (), "gpt2": (),
               "gemma2": (("softcap", "config.final_logit_softcapping"),),
               "gemma3_text": (("softcap", "config.final_logit_softcapping"),),
               "vaultgemma": (("softcap", "config.final_logit_softcapping"),),
               "nanochat": (("softcap", "config.final_logit_softcapping"),),
               "cohere": (("multiply", "logit_scale"),), "cohere2": (("multiply", "logit_scale"),),
               "granite": (("divide", "config.logits_scaling"),),
               "hyperclovax": (("multiply", "config.logits_scaling"),),
               "gemma": (), "phi3": (), "olmo2": ()}
    assert {kind: logit_steps(type(hf_model(kind))) for kind in by_hand} == by_hand
    recognised = [cls for cls in _causal_lm_classes() if not isinstance(logit_steps(cls), Unrecognised)]
    assert len(recognised) >= 40, [cls.__name__ for cls in recognised]  # 51 in transformers 5.25


def test_a_forward_that_does_more_than_llamas_is_refused_naming_the_line():
    """A router loss (Mixtral), a loss scaled after the cross-entropy (an edited subclass), GPT-2 with a second head,
    an instance's own loss function: refused, a forward naming the file and line of its first statement that
    differs from Llama's, and no chunked loss runs."""
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                        num_local_experts=2, num_experts_per_tok=1)
    mixtral = transformers.MixtralForCausalLM(config)
    why = logit_steps(type(mixtral))
    assert isinstance(why, Unrecognised) and "modeling_mixtral.py:" in why and "router" in why, why
    assert not supports_chunked_loss(mixtral)

    class Doubled(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            out.loss = out.loss * 2
            return out

    gpt2_heads = transformers.GPT2DoubleHeadsModel(hf_model("gpt2").config)  # GPT-2's model type, another loss
    assert isinstance(logit_steps(type(gpt2_heads)), Unrecognised) and not supports_chunked_loss(gpt2_heads)
    llama = hf_model("llama")
    llama.loss_function = lambda *args, **kwargs: 2 * llama.__class__.loss_function.fget(llama)(*args, **kwargs)
    assert not supports_chunked_loss(llama)  # an instance's own loss function, which the chunks would drop

    doubled = Doubled(hf_model("llama").config)
    why = logit_steps(Doubled)
    assert isinstance(why, Unrecognised) and "test_loss.py:" in why and "super().forward" in why, why
    with pytest.raises(ConfigError, match="does not know how Doubled computes its loss.*To resolve this error"):
        apply_chunked_loss(doubled)


# One-statement edits of Llama's forward that change its loss or logits (each a regular expression on the installed
# source and its replacement): each must be refused. The last is a step the chunks apply (an attribute's scale).
_EDITS = {
    "the head's input doubled": (r"self\.lm_head\((.*)\)\n", r"self.lm_head((\1) * 2)\n"),
    "the logits times a constant": (r"(\n(\s*)logits = self\.lm_head\(.*\)\n)", r"\1\2logits = logits * 2.0\n"),
    "the logits clamped": (r"(\n(\s*)logits = self\.lm_head\(.*\)\n)", r"\1\2logits = logits.clamp(-3.0, 3.0)\n"),
    "the loss doubled": (r"loss = self\.loss_function\(", r"loss = 2 * self.loss_function("),
    "the decoder's output doubled": (r"(hidden_states = outputs\.last_hidden_state)\n", r"\1 * 2\n"),
    "the returned logits doubled": (r"logits=logits,", r"logits=logits * 2,"),
}
_SCALED = (r"(\n(\s*)logits = self\.lm_head\(.*\)\n)", r"\1\2logits = logits * self.config.logit_scale\n")


def _edited_llama(tmp_path, name: str, pattern: str, replacement: str) -> type:
    """A LlamaForCausalLM subclass whose forward is the installed source with one edit, in a file of its own (the
    source ``logit_steps`` reads)."""
    import importlib.util
    import inspect
    import re
    import textwrap

    source = textwrap.dedent(inspect.getsource(inspect.unwrap(transformers.LlamaForCausalLM.forward)))
    source = "".join(line for line in source.splitlines(keepends=True) if not line.startswith("@"))
    edited, count = re.subn(pattern, replacement, source, count=1)
    assert count == 1, f"{name}: the installed forward has no {pattern!r}"
    module = tmp_path / f"edited_{abs(hash(name))}.py"
    module.write_text("from __future__ import annotations\nimport torch\nimport transformers\n"
                      "from transformers.models.llama.modeling_llama import *\n\n\n"
                      "class Edited(transformers.LlamaForCausalLM):\n" + textwrap.indent(edited, "    "))
    spec = importlib.util.spec_from_file_location(module.stem, module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded.Edited


@pytest.mark.parametrize("edit", list(_EDITS))
def test_a_one_statement_edit_of_llamas_forward_is_refused(tmp_path, edit):
    """The comparison with Llama's forward is exact but for what it normalises: an edit that changes the head's
    input, the logits, the loss or what is returned is refused, naming the edited file. The same file unedited is
    Llama's forward (no steps), and an attribute's scale is a step, so the harness reads what it writes."""
    why = logit_steps(_edited_llama(tmp_path, edit, *_EDITS[edit]))
    assert isinstance(why, Unrecognised) and "edited_" in why, (edit, why)
    assert logit_steps(_edited_llama(tmp_path, "unedited", r"(\n)", r"\1")) == ()
    assert logit_steps(_edited_llama(tmp_path, "scaled", *_SCALED)) == (("multiply", "config.logit_scale"),)


def test_a_forward_wrapped_by_a_decorator_from_outside_transformers_is_refused_naming_it():
    """``inspect.unwrap`` would read the source under any ``functools.wraps`` decorator, so a wrapper that doubles
    the loss would pass as Llama's forward. transformers' own decorators (``can_return_tuple`` on Llama's forward)
    are read through; another module's are refused, naming the wrapper's file and line."""
    import functools

    def doubling(forward):
        @functools.wraps(forward)
        def wrapper(self, *args, **kwargs):
            out = forward(self, *args, **kwargs)
            out.loss = None if out.loss is None else out.loss * 2
            return out
        return wrapper

    class Wrapped(transformers.LlamaForCausalLM):
        forward = doubling(transformers.LlamaForCausalLM.forward)

    assert hasattr(transformers.LlamaForCausalLM.forward, "__wrapped__")  # transformers' own wrapper
    assert logit_steps(transformers.LlamaForCausalLM) == ()
    why = logit_steps(Wrapped)
    assert isinstance(why, Unrecognised) and "doubling.<locals>.wrapper" in why and "test_loss.py:" in why, why
    with pytest.raises(ConfigError, match="does not know how Wrapped computes its loss.*wrapped by .*doubling"):
        apply_chunked_loss(Wrapped(hf_model("llama").config))


def test_a_trainable_logit_scale_is_refused_as_the_chunks_would_give_it_no_gradient():
    """The chunks' backward recomputes the head and gives its parameters their gradients, never a scale's (Cohere's
    logit_scale made an nn.Parameter: the model's own loss gives it one)."""
    cohere = hf_model("cohere")
    cohere.logit_scale = nn.Parameter(torch.tensor(float(cohere.logit_scale)))
    with pytest.raises(ConfigError, match=r"logit_scale, by which .* is trainable.*requires_grad_\(False\)"):
        apply_chunked_loss(cohere)
    cohere.logit_scale.requires_grad_(False)
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    want = cohere(x, labels=x).loss
    apply_chunked_loss(cohere, chunk_tokens=5)  # frozen: the constant the chunks take it as
    assert torch.allclose(cohere(x, labels=x).loss, want, rtol=1e-6)


@pytest.mark.parametrize("ignored", [False, True], ids=["all-labels", "ignored-labels"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_training_loops_chunked_loss_equals_the_models_own(kind, ignored):
    """As memtrain's loop calls it (``language_model_loss``: labels already shifted, the loss summed, ``kept=`` the
    host's count, so the ignored positions never reach the head): the model's own loss and gradients, within TOL and
    1e-5 of each gradient's largest entry, with its logits' scaling or soft-capping applied to each chunk. A
    transform that matters: the head's plain logits would give a loss 30% or more away."""
    model = hf_model(kind)
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    y = x.roll(-1, dims=1)
    if ignored:
        y[0, :10] = -100  # a prompt
        y[1, 20:] = -100  # padding
    kept = int((y != -100).sum())
    want = loss_and_grads(model, lambda m: m(x, labels=y, shift_labels=y, num_items_in_batch=1).loss)
    if kind in TRANSFORMED:
        with torch.no_grad():
            hidden = getattr(model, model.base_model_prefix)(x).last_hidden_state
            plain = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), y.flatten(), reduction="sum")
        assert logit_transform(model) is not None and abs(plain - want[0]) > 0.3 * want[0], (plain, want[0])
    apply_checkpointing(model)
    apply_chunked_loss(model, chunk_tokens=5)
    assert_same(loss_and_grads(model, lambda m: language_model_loss(m, x, y, kept=kept)), want)
    assert_same(loss_and_grads(model, lambda m: language_model_loss(m, x, y)), want)


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_a_model_that_transforms_its_logits_takes_memtrains_kernel_and_says_why(kind, monkeypatch):
    """torch's F.linear_cross_entropy takes the head's weight and computes the cross-entropy of its plain logits:
    for a model that scales or soft-caps them, auto picks memtrain's kernel, and the run's reason names the
    transform and the config field it comes from."""
    from memtrain.techniques.chunked_loss import TECHNIQUE

    model = hf_model(kind)
    reasons = TECHNIQUE.prepare_model(model, Choices(chunked_loss=True), chunk_tokens=8)["reasons"]
    transform = {"gemma2": "tanh(logits / 2.0) * 2.0 (config.final_logit_softcapping)",
                 "cohere": "logits * 0.25 (logit_scale)", "granite": "logits / 4.0 (config.logits_scaling)"}[kind]
    head = output_head(model)
    assert isinstance(head, LogitsHead) and head.head is model.lm_head and str(head.transform) == transform
    implementation, why = chunked_loss_implementation(head)
    assert implementation == "memtrain" and transform in why and "cannot apply it" in why, why
    assert reasons == [f"loss: 8 tokens of logits at a time with memtrain's kernel, because: {why}"], reasons
    if hasattr(F, "linear_cross_entropy"):  # and torch's op never runs
        monkeypatch.setattr(F, "linear_cross_entropy", lambda *args, **kwargs: pytest.fail("torch's op ran"))
    x = torch.randint(0, 128, (2, 16))
    model(x, labels=x).loss.backward()
    assert model.lm_head.weight.grad is not None
    with pytest.raises(ConfigError, match="nn.Linear head"):
        chunked_cross_entropy(torch.randn(4, 32), head, torch.zeros(4, dtype=torch.long), implementation="torch")


@pytest.mark.parametrize("steps", [
    (("softcap", 1.0, "cap"),),
    (("multiply", 2.0, "scale"), ("softcap", 1.5, "cap")),
    (("divide", 0.5, "scale"), ("softcap", 1.5, "cap")),
], ids=["softcap", "scale-then-softcap", "divide-then-softcap"])
@pytest.mark.parametrize("kept", [False, True])
def test_a_logits_head_equals_the_transformed_whole_logits_loss(steps, kept):
    """chunked_cross_entropy of a LogitsHead: the transform on each chunk's logits in forward and in backward's
    recompute, the ignored positions skipped before the head where ``kept`` is given; fp32: the loss within 1e-6,
    the gradients within 1e-5 of their largest entry."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 50)
    hidden = (torch.randn(3, 21, 16) * 5).requires_grad_()
    labels = torch.randint(0, 50, (3, 21))
    labels[0, :5] = -100
    transform = LogitTransform(steps)
    params = (hidden, *linear.parameters())
    whole = F.cross_entropy(transform(linear(hidden)).flatten(0, 1), labels.flatten(), reduction="sum")
    want = torch.autograd.grad(whole, params)
    count = int((labels != -100).sum()) if kept else None
    loss = chunked_cross_entropy(hidden, LogitsHead(linear, transform), labels, chunk_tokens=7, kept=count)
    got = torch.autograd.grad(loss, params)
    assert abs(loss.item() - whole.item()) <= 1e-6 * whole.item(), (loss.item(), whole.item())
    for g, w in zip(got, want, strict=True):
        diff, scale = (g - w).abs().max().item(), w.abs().max().item()
        assert diff <= 1e-5 * scale, f"max abs diff {diff:.3g} > 1e-5 x {scale:.3g}"
    plain = F.cross_entropy(linear(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    assert abs(plain.item() - whole.item()) > 0.1 * whole.item()  # the transform changes the loss


def test_the_estimate_of_a_softcapped_gemma2_equals_the_measurement():
    """The estimator traces the chunked loss with its soft-capping: on the CPU its saved bytes equal the meter's
    (memtrain's kernel: the hidden states and the labels), fewer than the whole-logits loss's."""
    from memtrain import estimate

    model = hf_model("gemma2")
    measured, predicted, input_ids = _chunked_saved_bytes(model)
    whole = estimate(model, input_ids, device="cpu", checkpointing="all")
    assert predicted == measured < whole.activation_bytes, (predicted, measured, whole.activation_bytes)


def _chunked_saved_bytes(model: nn.Module) -> tuple[int, int, torch.Tensor]:
    """A checkpointed step of ``model`` with the chunked loss (16 tokens a chunk): the meter's saved bytes, the
    estimate's, and the batch."""
    from memtrain import estimate

    input_ids = torch.randint(0, 128, (4, 32))
    apply_checkpointing(model)
    apply_chunked_loss(model, chunk_tokens=16)
    with MemoryMeter(model) as meter:
        loss = model(input_ids, labels=input_ids.clone()).loss
    loss.backward()
    predicted = estimate(model, input_ids, device="cpu", checkpointing="all", setup=Choices(chunked_loss=True))
    return meter.activation_bytes, predicted.activation_bytes, input_ids


def test_a_model_whose_forward_is_not_checked_is_refused_even_with_a_known_transform():
    """GraniteMoe divides its logits as Granite does, but its forward can add a router loss to the cross-entropy
    (output_router_logits): a forward that is not Llama's is refused, naming the fix. So is a known one whose
    scale is not where its forward reads it (an older or edited model)."""
    config = transformers.GraniteMoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                           num_local_experts=2, num_experts_per_tok=1, logits_scaling=4.0)
    model = transformers.GraniteMoeForCausalLM(config)
    assert isinstance(logit_steps(type(model)), Unrecognised) and not supports_chunked_loss(model)
    assert logit_transform(model) is None
    with pytest.raises(ConfigError, match="does not know how GraniteMoeForCausalLM computes its loss.*To resolve this error"):
        apply_chunked_loss(model)
    from memtrain import estimate

    with pytest.raises(ConfigError, match="pass chunked_loss=False"):
        estimate(config, (1, 8), setup=Choices(chunked_loss=True))
    cohere = hf_model("cohere")  # a checked type whose scale is not where its forward reads it: refused too
    del cohere.logit_scale
    with pytest.raises(ConfigError, match="CohereForCausalLM has no logit_scale, by which its forward"):
        apply_chunked_loss(cohere)


def test_checkpointing_plus_a_chunked_loss_cuts_the_llama_benchmark_saved_bytes_ten_x():
    """The CPU Llama of benchmarks/bench_checkpointing.py: layers alone stop at 8.9x, the loss's fp32 log-softmax."""
    model = hf_model("llama", layers=8, hidden=256, intermediate=688, vocab=2048, positions=256)
    input_ids = torch.randint(0, 2048, (8, 256), generator=torch.Generator().manual_seed(0))

    def saved() -> int:
        with MemoryMeter(model) as meter:
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return meter.activation_bytes

    none = saved()
    apply_checkpointing(model)
    layers_only = saved()
    apply_chunked_loss(model)
    chunked = saved()
    print(f"saved bytes: none {none / 2**20:.1f} MiB, checkpointing {layers_only / 2**20:.1f} MiB "
          f"({none / layers_only:.1f}x), + chunked loss {chunked / 2**20:.1f} MiB ({none / chunked:.1f}x)")
    assert none / layers_only < 10 <= none / chunked


def test_bad_input_is_one_config_error_each():
    with pytest.raises(ConfigError, match="chunk_tokens=0"):
        apply_chunked_loss(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, seq_len=8)), chunk_tokens=0)
    with pytest.raises(ConfigError, match="no linear output head"):
        apply_chunked_loss(nn.Linear(2, 2))
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=32)
    with pytest.raises(ConfigError, match="not a base model"):
        apply_chunked_loss(transformers.LlamaModel(config))
    with pytest.raises(ConfigError, match="do not match labels"):
        chunked_cross_entropy(torch.zeros(2, 3, 4), nn.Linear(4, 5), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_estimate_predicts_a_chunked_loss(kind):
    """On the CPU the estimate's saved bytes equal measure's exactly; under CUDA's rules (bf16) it runs too."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32)) if kind == "gpt" else hf_model("llama")
    input_ids = torch.randint(0, 128, (4, 32))
    apply_checkpointing(model)
    apply_chunked_loss(model)
    with MemoryMeter(model) as meter:
        # The GPT's loss summed, as memtrain's loop computes it and the estimate traces it.
        out = model(input_ids, input_ids.clone(), reduction="sum") if kind == "gpt" else \
            model(input_ids, labels=input_ids.clone())
    getattr(out, "loss", out).backward()
    from memtrain import estimate

    predicted = estimate(model, input_ids, device="cpu", checkpointing="all", setup=Choices(chunked_loss=True))
    whole = estimate(model, input_ids, device="cpu", checkpointing="all")
    assert predicted.activation_bytes == meter.activation_bytes < whole.activation_bytes
    assert any("apply_chunked_loss" in a for a in predicted.assumptions)
    cuda = estimate(model, input_ids, device="cuda", precision="bf16-mixed", checkpointing="all",
                    setup=Choices(chunked_loss=True))
    assert cuda.activation_bytes < estimate(model, input_ids, device="cuda", precision="bf16-mixed",
                                            checkpointing="all").activation_bytes


def test_a_compiled_model_with_checkpointing_and_a_chunked_loss_gives_the_same_gradients():
    """torch.compile (aot_eager: AOTAutograd's graphs without code generation, seconds on CPU) composes with both."""
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    def run(memtrain: bool, compiled: bool):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32))
        if memtrain:
            apply_checkpointing(model)
            apply_chunked_loss(model, chunk_tokens=16)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        return loss_and_grads(model, lambda m: forward(x, x, reduction="sum"))

    assert_same(run(memtrain=True, compiled=True), run(memtrain=False, compiled=False))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_return_dict_false_gives_a_tuple_as_the_model_does(kind):
    model = hf_model(kind)
    x = torch.randint(0, 128, (2, 12))
    plain = model(x, labels=x, return_dict=False)
    apply_chunked_loss(model)
    chunked = model(x, labels=x, return_dict=False)
    assert isinstance(plain, tuple) and isinstance(chunked, tuple)
    torch.testing.assert_close(chunked[0], plain[0], **TOL)  # the loss first; no logits follow it
    assert not any(isinstance(t, torch.Tensor) and t.shape[-1] == 128 for t in chunked[1:])
    if kind == "gpt2":  # GPT-2's own output class, cross-attention field included
        assert type(model(x, labels=x)).__name__ == "CausalLMOutputWithCrossAttentions"


def test_chunking_a_compiled_model_chunks_what_it_compiles():
    """apply_chunked_loss(torch.compile(model)) patches the compiled module, so the compiled forward runs the chunks."""
    model = hf_model("llama")
    x = torch.randint(0, 128, (2, 16))
    want = loss_and_grads(model, lambda m: m(x, labels=x).loss)
    compiled = torch.compile(model, backend="aot_eager")
    assert supports_chunked_loss(compiled)
    apply_chunked_loss(compiled, chunk_tokens=8)
    assert chunked_loss_kind(compiled) == "hf" and chunked_loss_kind(model) == "hf"
    assert compiled(x, labels=x).logits is None
    assert_same(loss_and_grads(model, lambda m: compiled(x, labels=x).loss), want)
    assert remove_chunked_loss(compiled) and chunked_loss_kind(model) is None


def test_an_empty_batch_gives_a_zero_loss_backward_can_run_through():
    head = nn.Linear(8, 16)
    loss = chunked_cross_entropy(torch.zeros(0, 5, 8, requires_grad=True), head, torch.zeros(0, 5, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(head.weight.grad) == 0


def test_bf16_autocast_rounds_like_the_whole_logits_loss():
    """Under bf16 autocast each chunk's logits round to bf16 as the whole logits do: the loss agrees to 1e-3
    relative, the gradients to 2e-2 of their largest entry (bf16 keeps 8 bits of mantissa)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))

    def call(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, x, reduction="sum")

    (want_loss, want_grads) = loss_and_grads(model, call)
    apply_chunked_loss(model, chunk_tokens=16)
    (got_loss, got_grads) = loss_and_grads(model, call)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-3, atol=0)
    for name, grad in want_grads.items():
        scale = grad.abs().max().item()
        assert (got_grads[name] - grad).abs().max().item() <= 2e-2 * scale, name


def test_a_deep_copy_of_a_chunked_model_chunks_its_own_weights():
    import copy

    model = hf_model("llama")
    apply_chunked_loss(model)
    twin = copy.deepcopy(model)
    assert chunked_loss_kind(twin) == "hf" and twin.forward.model is twin and twin.forward.original.__self__ is twin
    x = torch.randint(0, 128, (2, 8))
    twin(x, labels=x).loss.backward()
    assert all(p.grad is None for p in model.parameters()) and twin.lm_head.weight.grad is not None


def test_models_it_cannot_chunk_are_refused_with_the_fix():
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
                                        num_local_experts=2, num_experts_per_tok=1)  # a router loss
    from memtrain import estimate

    with pytest.raises(ConfigError, match="pass chunked_loss=False"):
        estimate(config, (1, 8), setup=Choices(chunked_loss=True))

    class OldForward(transformers.LlamaForCausalLM):  # transformers < 4.48: no loss arguments in the forward
        def forward(self, input_ids=None, labels=None):
            return super().forward(input_ids=input_ids, labels=labels)

    old = OldForward(hf_model("llama").config)
    assert not supports_chunked_loss(old)
    with pytest.raises(ConfigError, match="upgrade transformers"):
        apply_chunked_loss(old)


# -- the two kernels: torch's F.linear_cross_entropy and memtrain's --------------------------------------------
@pytest.mark.parametrize("implementation", [TORCH_KERNEL, "memtrain"])
@pytest.mark.parametrize("bias", [False, True])
def test_both_kernels_equal_the_whole_logits_loss_in_fp32(implementation, bias):
    """fp32: the loss within rtol 1e-5, every gradient within 1e-5 of its largest entry (chunking reorders sums)."""
    torch.manual_seed(0)
    head = nn.Linear(32, 300, bias=bias)
    hidden = torch.randn(2, 45, 32, requires_grad=True)
    labels = torch.randint(0, 300, (2, 45))
    labels[1, 30:] = -100
    params = (hidden, *head.parameters())
    whole = F.cross_entropy(head(hidden).float().flatten(0, 1), labels.flatten(), reduction="sum")
    want = torch.autograd.grad(whole * 0.5, params)  # a scale in front, as a mean or an accumulator applies
    loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, implementation=implementation)
    got = torch.autograd.grad(loss * 0.5, params)
    torch.testing.assert_close(loss, whole, rtol=1e-5, atol=0)
    for g, w in zip(got, want, strict=True):
        diff, scale = (g - w).abs().max().item(), w.abs().max().item()
        assert diff <= 1e-5 * scale, f"{implementation}: max abs diff {diff:.3g} > 1e-5 x {scale:.3g}"


@pytest.mark.parametrize("implementation", [TORCH_KERNEL, "memtrain"])
def test_both_kernels_round_like_the_whole_logits_loss_under_bf16_autocast(implementation):
    """bf16 autocast: the whole-logits loss rounds the logits to bf16 (8 bits of mantissa); torch's kernel keeps
    them in fp32 and rounds each token's loss to bf16 instead. Loss within 2e-3 relative, gradients within 2e-2
    of their largest entry."""
    torch.manual_seed(0)
    head = nn.Linear(64, 500, bias=False)
    hidden = torch.randn(256, 64, requires_grad=True)
    labels = torch.randint(0, 500, (256,))
    params = (hidden, head.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = F.cross_entropy(head(hidden).float(), labels, reduction="sum")
        loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens=64, implementation=implementation)
    want, got = torch.autograd.grad(whole, params), torch.autograd.grad(loss, params)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - whole.item()) <= 2e-3 * whole.item(), (loss.item(), whole.item())
    for g, w in zip(got, want, strict=True):
        diff, scale = (g.float() - w.float()).abs().max().item(), w.abs().max().item()
        assert diff <= 2e-2 * scale, f"{implementation}: max abs diff {diff:.3g} > 2e-2 x {scale:.3g}"


@pytest.mark.skipif(not TORCHS_OP, reason=f"torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13 "
                    "has): every head takes memtrain's kernel, as the next test checks")
def test_the_choice_of_kernel_and_its_reason():
    kind, reason = chunked_loss_implementation(nn.Linear(4, 8))
    assert kind == "torch" and "linear_cross_entropy" in reason

    class Scaled(nn.Linear):  # a subclass may change what forward computes: torch's op would skip it
        def forward(self, x):
            return super().forward(x) * 2

    kind, reason = chunked_loss_implementation(Scaled(4, 8))
    assert kind == "memtrain" and "Scaled" in reason
    hooked = nn.Linear(4, 8)
    hooked.register_forward_pre_hook(lambda module, args: None)
    kind, reason = chunked_loss_implementation(hooked)
    assert kind == "memtrain" and "hooks" in reason
    linear = nn.Linear(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # half inputs on the CPU: memtrain's (measured faster)
        kind, reason = chunked_loss_implementation(linear)
    assert kind == "memtrain" and "bfloat16 inputs on the CPU" in reason
    assert chunked_loss_implementation(linear, dtype=torch.float16)[0] == "memtrain"
    assert chunked_loss_implementation(linear, dtype=torch.float32)[0] == "torch"
    head = Scaled(4, 8)  # auto picks memtrain's kernel, and it runs the subclass's forward
    hidden, labels = torch.randn(10, 4), torch.randint(0, 8, (10,))
    torch.testing.assert_close(chunked_cross_entropy(hidden, head, labels, chunk_tokens=3),
                               F.cross_entropy(head(hidden), labels, reduction="sum"), **TOL)
    with pytest.raises(ConfigError, match="nn.Linear head"):
        chunked_cross_entropy(hidden, lambda h: h, labels, implementation="torch")


def test_without_torchs_op_every_head_takes_memtrains_kernel_and_the_reason_says_why(monkeypatch):
    """torch < 2.13 has no F.linear_cross_entropy (hidden here, so that every torch runs this): "auto" takes
    memtrain's kernel, the reason names the torch version, and asking for torch's kernel is the error that says so."""
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    head = nn.Linear(4, 8)
    kind, reason = chunked_loss_implementation(head)
    assert kind == "memtrain" and f"torch {torch.__version__} has no chunked F.linear_cross_entropy" in reason, reason
    hidden, labels = torch.randn(10, 4), torch.randint(0, 8, (10,))
    torch.testing.assert_close(chunked_cross_entropy(hidden, head, labels, chunk_tokens=3),
                               F.cross_entropy(head(hidden), labels, reduction="sum"), **TOL)
    with pytest.raises(ConfigError, match=r"needs torch >= 2\.13's F\.linear_cross_entropy"):
        chunked_cross_entropy(hidden, head, labels, implementation="torch")


class _FullSizeAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the new tensors of one shape that ops allocate (views and in-place results are not new)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.count += sum(isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape
                          and t.untyped_storage().data_ptr() not in given for t in outs)
        return out


def test_memtrains_backward_allocates_one_gradient_of_the_hidden_states_not_one_per_chunk():
    """Each chunk's gradient is written into one preallocated gradient of the hidden states. The old kernel (a
    checkpoint per slice of hidden) allocated a zero-filled full-size gradient per chunk in the slice's backward
    and added them up: 8 chunks here, 8 allocations of 256 x 64 x 4 bytes plus the sums."""
    torch.manual_seed(0)
    head = nn.Linear(64, 100, bias=False)
    hidden = torch.randn(256, 64, requires_grad=True)
    labels = torch.randint(0, 100, (256,))
    loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens=32, implementation="memtrain")
    with _FullSizeAllocations(hidden.shape) as counter:
        loss.backward()
    assert counter.count == 1, f"{counter.count} tensors of the hidden states' size {tuple(hidden.shape)} in backward"
    want = torch.autograd.grad(F.cross_entropy(head(hidden), labels, reduction="sum"), hidden)[0]
    torch.testing.assert_close(hidden.grad, want, rtol=1e-5, atol=1e-6)


def test_estimate_traces_the_kernel_the_cpu_run_takes(monkeypatch):
    """memtrain's kernel on a Llama (the auto choice there is torch's, covered above): estimate == measure."""
    import memtrain.loss

    monkeypatch.setattr(memtrain.loss, "chunked_loss_implementation", lambda head: ("memtrain", "test"))
    measured, predicted, _ = _chunked_saved_bytes(hf_model("llama"))
    assert predicted == measured, (predicted, measured)


def test_activation_offload_keeps_the_loss_tail_on_the_device_with_memtrains_kernel():
    """The offloader hooks the head (so auto picks memtrain's kernel): the kernel's saved hidden states and labels
    stay on the device as the whole-logits loss's tensors do; the blocks' bytes crossing the link are the same,
    and so are the loss and gradients (fp32, 1e-5 of the largest entry)."""
    from memtrain.offload import ActivationOffloader, CpuTransport

    def run(chunked: bool):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32))
        if chunked:
            apply_chunked_loss(model, chunk_tokens=16)
        offloader = ActivationOffloader(CpuTransport(), model=model, min_bytes=1, host_budget_bytes=2**24,
                                        slab_bytes=2**16)
        x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
        with offloader:
            assert not chunked or chunked_loss_implementation(model.head)[0] == "memtrain"
            loss = model(x, x, reduction="sum")
        loss.backward()
        return offloader.stats(), (loss.detach(), {n: p.grad for n, p in model.named_parameters()})

    (whole_stats, want), (chunked_stats, got) = run(False), run(True)
    assert chunked_stats.offloaded_bytes == whole_stats.offloaded_bytes > 0
    assert dict(chunked_stats.kept)["logits"] == 2  # the hidden states and the labels, kept as the tail
    assert_same(got, want)


def test_memtrains_kernel_holds_one_chunk_of_logits_and_two_head_gradients_at_its_peak():
    """Backward recomputes a chunk's logits and turns them into their gradient in place (softmax - one hot):
    one (chunk x vocabulary) fp32 buffer, not the three that autograd through F.cross_entropy holds (the
    log-softmax, its gradient, the logits' gradient). Peak over forward + backward: that buffer, the running sum
    of the head's weight gradient and one chunk's, the hidden states' gradient; 64 KiB of slack for small
    temporaries (row maxima, sums). The kernel memtrain had before (a checkpoint per slice) peaked at 3.6 MiB."""
    torch.manual_seed(0)
    tokens, width, vocab, chunk = 512, 64, 2000, 128
    head = nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(tokens, width, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    labels[:40] = -100

    def step():
        hidden.grad = head.weight.grad = None
        chunked_cross_entropy(hidden, head, labels, chunk_tokens=chunk, implementation="memtrain").backward()

    step()
    peak = cpu_allocation_peak_bytes(step)
    bound = chunk * vocab * 4 + 2 * vocab * width * 4 + tokens * width * 4 + 64 * 2**10
    assert peak <= bound, f"peak {peak} bytes > {bound}"
    want = torch.autograd.grad(F.cross_entropy(head(hidden), labels, reduction="sum"), (hidden, head.weight))
    for got, w in zip((hidden.grad, head.weight.grad), want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


# -- labels: an ignore_index that is a valid or out-of-range id, and out-of-range labels ------------------------
@pytest.mark.parametrize("implementation", [TORCH_KERNEL, "memtrain"])
def test_an_ignore_index_equal_to_the_vocabulary_size_is_ignored_as_torch_does(implementation):
    """ignore_index = vocab (not negative, one past the last id): the ignored rows carry no loss and no gradient.

    The backward must not gather the logit at the ignored label (clamping it at 0 left vocab out of range)."""
    torch.manual_seed(0)
    vocab = 300
    head = nn.Linear(32, vocab)
    hidden = torch.randn(2, 45, 32, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 45))
    labels[1, 30:] = vocab
    labels[0, :5] = vocab
    params = (hidden, *head.parameters())
    whole = F.cross_entropy(head(hidden).float().flatten(0, 1), labels.flatten(), ignore_index=vocab,
                            reduction="sum")
    want = torch.autograd.grad(whole, params)
    loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, ignore_index=vocab,
                                 implementation=implementation)
    got = torch.autograd.grad(loss, params)
    assert abs(loss.item() - whole.item()) <= 1e-6 * abs(whole.item()), (
        f"{implementation}: loss {loss.item():.9g} != F.cross_entropy's {whole.item():.9g} (rtol 1e-6)")
    for g, w in zip(got, want, strict=True):
        diff, scale = (g - w).abs().max().item(), w.abs().max().item()
        assert diff <= 1e-6 * max(scale, 1.0), f"{implementation}: max abs diff {diff:.3g} > 1e-6 x {scale:.3g}"
    assert got[0][1, 30:].abs().max().item() == 0, "ignored positions must get a zero gradient"


@pytest.mark.parametrize("implementation", [TORCH_KERNEL, "memtrain"])
@pytest.mark.parametrize("bad_label", [300, 1000, -5])
def test_labels_outside_the_vocabulary_that_are_not_ignored_are_an_error(implementation, bad_label):
    """A label outside [0, vocab) that is not ignore_index is a bug in the data: an error, never a silent loss."""
    torch.manual_seed(0)
    head = nn.Linear(32, 300)
    hidden = torch.randn(2, 45, 32, requires_grad=True)
    labels = torch.randint(0, 300, (2, 45))
    labels[0, 7] = bad_label
    with pytest.raises((IndexError, RuntimeError, ConfigError), match=r"(?i)out of bounds|out of range|label"):
        loss = chunked_cross_entropy(hidden, head, labels, chunk_tokens=16, implementation=implementation)
        loss.backward()
