"""estimate: the saved-activation bytes equal measure's on the CPU; the peak model holds what the step holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memtrain import apply_checkpointing, measure, remove_checkpointing
from memtrain.errors import ConfigError, MemtrainError
from memtrain.estimate import estimate
from memtrain.models import GPT, GPT_PRESETS

transformers = pytest.importorskip("transformers")

B, T, V = 2, 32, 256
POLICIES = {"none": None, "all": {"every": 1}, "every:2": {"every": 2}}


def _llama_config(**overrides):
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=128)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def _gpt2_config():
    return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=64,
                                   bos_token_id=0, eos_token_id=0)


def _models():
    torch.manual_seed(0)
    return {
        "gpt": GPT(GPT_PRESETS["gpt-tiny"]),
        "llama": transformers.LlamaForCausalLM(_llama_config()),
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


def test_meta_model_and_config_give_the_same_estimate_as_the_real_model():
    torch.manual_seed(0)
    real = GPT(GPT_PRESETS["gpt-tiny"])
    with torch.device("meta"):
        meta = GPT(GPT_PRESETS["gpt-tiny"])
    a, b = estimate(real, (4, 64), device="cpu"), estimate(meta, (4, 64), device="cpu")
    assert (a.activation_bytes, a.peak_bytes) == (b.activation_bytes, b.peak_bytes)

    config = _llama_config()
    from_config = estimate(config, (B, T))
    from_module = estimate(transformers.LlamaForCausalLM(config), (B, T))
    assert from_config.activation_bytes == from_module.activation_bytes
    assert from_config.peak_bytes == from_module.peak_bytes


def test_batch_forms_agree():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    tokens = torch.zeros(4, 64, dtype=torch.long, device="meta")
    reports = [
        estimate(model, tokens, device="cpu"),
        estimate(model, (4, 64), device="cpu"),
        estimate(model, None, micro_batch_size=4, seq_len=64, device="cpu"),
        estimate(model, (1, 16), micro_batch_size=4, seq_len=64, device="cpu"),
    ]
    assert len({r.activation_bytes for r in reports}) == 1, [r.activation_bytes for r in reports]
    assert estimate(model, (8, 64), device="cpu").activation_bytes > reports[0].activation_bytes


def test_steady_state_peak_holds_model_state_and_activations():
    """Without checkpointing the peak comes at the start of backward: everything saved is still alive."""
    model = transformers.LlamaForCausalLM(_llama_config())
    r = estimate(model, (4, 64), device="cpu", optimizer="adamw")
    assert r.optimizer_state_bytes == 2 * r.parameter_bytes  # fp32 exp_avg + exp_avg_sq
    floor = r.parameter_bytes + r.optimizer_state_bytes + r.activation_bytes
    assert r.peak_bytes > floor, (r.peak_bytes, floor)
    # Its largest extra is the fp32 loss on the logits: log-softmax output, its grad, the logits grad.
    logits_fp32 = 4 * 64 * V * 4
    # (less a few KiB: the loss's own small saved tensors are freed by the time its gradients exist)
    assert r.peak_bytes >= floor + 2 * logits_fp32 - 4096, (r.peak_bytes, floor, logits_fp32)
    assert "logits" in r.peak_phase, r.peak_phase
    names = [phase for phase, _ in r.phase_bytes]
    assert names == ["forward", "backward", "step"], names


@pytest.mark.parametrize("optimizer, factor", [("sgd", 0), ("sgd-momentum", 1), ("adamw", 2)])
def test_optimizer_state_by_kind(optimizer, factor):
    model = GPT(GPT_PRESETS["gpt-tiny"])
    r = estimate(model, (2, 64), device="cpu", optimizer=optimizer)
    assert r.optimizer_state_bytes == factor * r.parameter_bytes, (optimizer, r.optimizer_state_bytes)


def test_offloaded_optimizer_state_moves_to_the_host():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    on_device = estimate(model, (2, 64), device="cpu", optimizer="adamw")
    offloaded = estimate(model, (2, 64), device="cpu", optimizer="adamw-offload")
    n = sum(p.numel() for p in model.parameters())
    # fp32 master, two moments and a gradient buffer (16 bytes a parameter), plus step counters and alignment
    assert 16 * n <= offloaded.host_bytes <= 16.2 * n, (offloaded.host_bytes, 16 * n)
    assert on_device.peak_bytes - offloaded.peak_bytes == on_device.optimizer_state_bytes


def test_adafactor_state_is_factored():
    layer = nn.Sequential(nn.Linear(256, 512, bias=False))
    r = estimate(layer, torch.zeros(4, 256, device="meta"), device="cpu", optimizer="adafactor")
    assert r.optimizer_state_bytes == (512 + 256) * 4, r.optimizer_state_bytes  # a row and a column, fp32


def test_cuda_rules_pick_the_attention_kernel():
    """fp32 grouped-query attention has no fused CUDA kernel: the math kernel saves the T x T attention matrix.
    bf16 goes to flash attention, and so does a model without grouped-query heads in fp32 (memory-efficient)."""
    t, heads, layers = 256, 4, 2
    gqa = _llama_config(num_hidden_layers=layers, max_position_embeddings=t)
    mha = _llama_config(num_hidden_layers=layers, num_key_value_heads=heads, max_position_embeddings=t)
    attention_matrices = layers * 1 * heads * t * t * 4
    fp32_gqa = estimate(gqa, (1, t), precision="fp32").activation_bytes
    bf16_gqa = estimate(gqa, (1, t), precision="bf16-mixed").activation_bytes
    fp32_mha = estimate(mha, (1, t), precision="fp32").activation_bytes
    # (the MHA model's larger key/value projections save a little more, hence 0.9)
    assert fp32_gqa - fp32_mha >= 0.9 * attention_matrices, (fp32_gqa, fp32_mha, attention_matrices)
    assert bf16_gqa < fp32_mha < fp32_gqa, (bf16_gqa, fp32_mha, fp32_gqa)


def test_cuda_autocast_rules_and_allocator_rounding():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    fp32 = estimate(model, (4, 64), precision="fp32")
    bf16 = estimate(model, (4, 64), precision="bf16-mixed")
    assert bf16.activation_bytes < fp32.activation_bytes, (bf16.activation_bytes, fp32.activation_bytes)
    cpu = estimate(model, (4, 64), device="cpu")
    # Every CUDA block is a multiple of 512 bytes, and cuBLAS workspaces come on top.
    assert fp32.peak_bytes % 512 == 0 and fp32.peak_bytes > cpu.peak_bytes + 32 * 2**20
    # With checkpointing the recompute runs under the same (emulated) autocast as the forward: no dtype mismatch.
    estimate(model, (4, 64), precision="bf16-mixed", checkpointing="all")


def test_cpu_autocast_bf16():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    x = torch.randint(0, V, (4, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = measure(lambda: model(x, x.clone()), model=model)
    estimated = estimate(model, x, device="cpu", precision="bf16-mixed")
    assert estimated.activation_bytes == measured.activation_bytes, (estimated.activation_bytes,
                                                                       measured.activation_bytes)


def test_bad_arguments_are_all_reported_at_once():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as info:
        estimate(model, (2, 16), device="tpu", precision="bf16", optimizer="lion", checkpointing="sometimes")
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert all("To resolve this error" in p for p in problems)
    with pytest.raises(ConfigError, match="micro_batch_size and seq_len"):
        estimate(model)
    with pytest.raises(ConfigError, match="positions"):
        estimate(model, (2, 65), device="cpu")
    with pytest.raises(ConfigError, match="not an nn.Module"):
        estimate("gpt2", (2, 16))


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


def test_batch_that_does_not_fit_the_model_is_a_clear_error():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(MemtrainError, match="wte") as info:
        estimate(model, torch.zeros(2, 16), device="cpu")  # float "tokens" into an embedding
    assert "To resolve this error" in str(info.value)


def test_replaying_identical_meta_calls_changes_nothing():
    config = _llama_config(num_hidden_layers=3)
    for policy in ("none", "all"):
        fast = estimate(config, (2, 64), precision="bf16-mixed", checkpointing=policy)
        slow = estimate(config, (2, 64), precision="bf16-mixed", checkpointing=policy, replay=False)
        assert (fast.peak_bytes, fast.activation_bytes, fast.phase_bytes) == (
            slow.peak_bytes, slow.activation_bytes, slow.phase_bytes), (policy, fast, slow)


def test_hf_config_file_and_an_already_checkpointed_model(tmp_path):
    config = _llama_config()
    path = tmp_path / "config.json"
    config.to_json_file(path)
    from memtrain.estimate import hf_config_from_file

    loaded = hf_config_from_file(path)
    assert estimate(loaded, (B, T)).peak_bytes == estimate(config, (B, T)).peak_bytes
    (tmp_path / "bad.json").write_text('{"hidden_size": 64}')
    with pytest.raises(ConfigError, match="model_type"):
        hf_config_from_file(tmp_path / "bad.json")
    # A model already wrapped by apply_checkpointing is estimated with the policy asked for, and stays wrapped.
    model = GPT(GPT_PRESETS["gpt-tiny"])
    plain = estimate(model, (2, 64), checkpointing="all")
    apply_checkpointing(model, every=2)
    assert estimate(model, (2, 64), checkpointing="all").activation_bytes == plain.activation_bytes
    assert "forward" in model.blocks[0].__dict__ and "forward" not in model.blocks[1].__dict__


def test_activation_offload_moves_saved_bytes_to_the_host():
    """Offloaded: every saved storage of 1 MiB or more that is not a weight; with checkpointing, the blocks' inputs."""
    config = _llama_config(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, max_position_embeddings=256)
    b, t = 4, 256
    hidden = b * t * 512 * 4  # one block input: the fp32 residual stream, 2 MiB
    kept = estimate(config, (b, t), checkpointing="all")
    offloaded = estimate(config, (b, t), checkpointing="all", offload_activations=True)
    assert offloaded.host_bytes == 4 * hidden, (offloaded.host_bytes, 4 * hidden)
    assert offloaded.activation_bytes == kept.activation_bytes  # still saved, only elsewhere
    after_forward = dict(kept.phase_bytes)["forward"] - dict(offloaded.phase_bytes)["forward"]
    assert after_forward == 4 * hidden, (after_forward, 4 * hidden)  # all of them off the device then
    assert offloaded.peak_bytes <= kept.peak_bytes, (offloaded.peak_bytes, kept.peak_bytes)
    plain = estimate(config, (b, t))
    plain_offloaded = estimate(config, (b, t), offload_activations=True)
    assert plain_offloaded.host_bytes > 0.5 * plain.activation_bytes, (plain_offloaded.host_bytes,
                                                                       plain.activation_bytes)
    moved = dict(plain.phase_bytes)["forward"] - dict(plain_offloaded.phase_bytes)["forward"]
    assert moved == plain_offloaded.host_bytes, (moved, plain_offloaded.host_bytes)
    assert plain_offloaded.peak_bytes < plain.peak_bytes, (plain_offloaded.peak_bytes, plain.peak_bytes)


def test_bad_checkpointing_arguments_and_flags_are_config_errors():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError, match="unknown apply_checkpointing arguments"):
        estimate(model, (2, 32), device="cpu", checkpointing={"evry": 2})
    with pytest.raises(ConfigError) as info:
        estimate(model, (2, 32), device="gpu", checkpointing=0, offload_activations="yes")
    assert len(info.value.problems) == 3, info.value.problems


def test_only_the_loss_outlives_forward_unless_the_output_is_kept():
    """memtrain's loop keeps the loss, not the output: the logits (here fp32: no autocast) die after forward. A loop
    holding ``out`` until backward keeps them alive at the backward's peak, on top."""
    config = _llama_config(vocab_size=8192)
    b, t = 4, 64
    logits = b * t * 8192 * 4
    dropped = estimate(config, (b, t), device="cpu", checkpointing="all")
    kept = estimate(config, (b, t), device="cpu", checkpointing="all", keep_output=True)
    assert kept.peak_bytes - dropped.peak_bytes == logits, (kept.peak_bytes - dropped.peak_bytes, logits)
    assert kept.activation_bytes == dropped.activation_bytes


@pytest.mark.parametrize("batch, bad", [
    ((-1, 8), ["dimension 0 is -1"]),
    ((0, 8), ["dimension 0 is 0"]),
    ((2, 0), ["dimension 1 is 0"]),
    ((True, 8), ["dimension 0 is True"]),
    ((2.0, 8), ["dimension 0 is 2.0"]),
    ((2, 8.5), ["dimension 1 is 8.5"]),
    ((-2, 0.5), ["dimension 0 is -2", "dimension 1 is 0.5"]),
    ({"input_ids": (2, -8), "labels": (0, 8)}, ["batch['input_ids'] of shape (2, -8): dimension 1 is -8",
                                               "batch['labels'] of shape (0, 8): dimension 0 is 0"]),
    (torch.zeros(0, 8, dtype=torch.long), ["dimension 0 is 0"]),
])
def test_every_dimension_of_the_batch_must_be_an_integer_of_at_least_one(batch, bad):
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as info:
        estimate(model, batch, device="cpu")
    message = str(info.value)
    for fragment in bad:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert "To resolve this error" in message and message.count("To resolve this error") == len(info.value.problems)


def test_bad_micro_batch_size_and_seq_len_are_both_reported():
    model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as info:
        estimate(model, micro_batch_size=0, seq_len=True, device="cpu")
    message = str(info.value)
    assert "micro_batch_size=0" in message and "seq_len=True" in message, message


@pytest.mark.parametrize("weights_dtype", [None, "bf16"])
def test_the_offloaded_adamws_bytes_are_optimizer_memorys_byte_for_byte(weights_dtype):
    """optimizer="adamw-offload" (CPUOffloadOptimizer, every parameter's state on the host) and
    memtrain.optim.optimizer_memory(offload_fraction=1.0) are one byte model: they cannot drift apart."""
    from memtrain.optim import optimizer_memory

    model = GPT(GPT_PRESETS["gpt-tiny"])
    dtype = torch.bfloat16 if weights_dtype else torch.float32
    params = [(p.numel(), dtype) for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    want = optimizer_memory(params, offload_fraction=1.0, device_type="cpu")
    for kwargs in ({"optimizer": "adamw-offload"}, {"optimizer": "adamw", "offload_fraction": 1.0}):
        got = estimate(model, (2, 16), device="cpu", weights_dtype=weights_dtype, **kwargs)
        assert got.host_bytes == want.host_bytes, (kwargs, weights_dtype, got.host_bytes, want.host_bytes)
        assert got.optimizer_state_bytes == want.state_bytes, (kwargs, got.optimizer_state_bytes, want.state_bytes)
