"""Checkpointing: parity first (bitwise, fp32, CPU), then the bytes it saves, then bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain import (
    ConfigError,
    apply_checkpointing,
    checkpoint_sequential,
    measure,
    remove_checkpointing,
)
from memtrain.checkpointing import checkpointed_blocks
from memtrain.models import GPT, GPTConfig, ResNet


def assert_grads_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None, name
        diff = (pa.grad - pb.grad).abs().max().item()
        assert torch.equal(pa.grad, pb.grad), f"{name}: gradients differ, max abs diff {diff:.3e}"


def assert_buffers_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert torch.equal(ba, bb), f"buffer {name} differs: {ba.flatten()[:4]} vs {bb.flatten()[:4]}"


def run_twice(model: nn.Module, step, **checkpoint_kwargs) -> tuple[nn.Module, nn.Module, object, object]:
    """The same seeded step on a plain copy and a checkpointed copy; returns both models and their reports."""
    plain, wrapped = model, copy.deepcopy(model)
    apply_checkpointing(wrapped, **checkpoint_kwargs)
    torch.manual_seed(1234)
    plain_report = measure(lambda: step(plain), model=plain)
    torch.manual_seed(1234)
    wrapped_report = measure(lambda: step(wrapped), model=wrapped)
    return plain, wrapped, plain_report, wrapped_report


def gpt(n_layer: int = 8, dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=128, seq_len=64, dropout=dropout))


def small_gpt(n_layer: int, dropout: float = 0.1) -> GPT:
    """For tests of wrapping and copying, where the model's size proves nothing."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, seq_len=64, dropout=dropout))


def gpt_step(model: GPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 256, (4, 64), generator=g)
    return model(x, torch.roll(x, -1, dims=1))


# -- parity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, {"every": 2}, {"selective": ("matmul", "attention")}],
                         ids=["all", "every2", "selective"])
def test_gpt_with_dropout_gradients_bitwise_equal(kwargs):
    plain, wrapped, _, _ = run_twice(gpt(dropout=0.1), gpt_step, **kwargs)
    assert_grads_equal(plain, wrapped)


def test_resnet_gradients_and_batchnorm_buffers_bitwise_equal():
    torch.manual_seed(0)
    model = ResNet(width=8, num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    plain, wrapped, _, _ = run_twice(model, lambda m: m(x).logsumexp(1).sum())
    assert_grads_equal(plain, wrapped)
    assert_buffers_equal(plain, wrapped)
    bn = wrapped.layer1[0].bn1
    assert bn.num_batches_tracked.item() == 1, "running stats must be updated once per forward"


def test_torch_checkpoint_alone_updates_batchnorm_twice():
    """The bug memtrain fixes (pytorch issue 96136): proves the buffer parity test above can fail."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    x = torch.randn(2, 3, 8, 8)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert block[1].num_batches_tracked.item() == 2


def test_checkpoint_sequential_parity_and_batchnorm():
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2)) for _ in range(4)])
    twin = copy.deepcopy(layers)
    x = torch.randn(8, 16)
    torch.manual_seed(5)
    layers(x).sum().backward()
    torch.manual_seed(5)
    checkpoint_sequential(twin, 2, x).sum().backward()
    assert_grads_equal(layers, twin)
    assert_buffers_equal(layers, twin)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, attention_dropout=0.1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def hf_step(model) -> torch.Tensor:
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    return model(input_ids=x, labels=x).loss


@pytest.mark.parametrize("build", [_hf_llama, _hf_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("kwargs", [{}, {"every": 2}, {"selective": ("matmul",)}], ids=["all", "every2", "selective"])
def test_hugging_face_models_gradients_bitwise_equal(build, kwargs):
    model = build()
    model.train()
    plain, wrapped, plain_report, wrapped_report = run_twice(model, hf_step, **kwargs)
    assert_grads_equal(plain, wrapped)
    assert wrapped_report.activation_bytes < plain_report.activation_bytes


def test_hugging_face_blocks_detected_and_use_cache_switched_off():
    model = _hf_llama()
    assert model.config.use_cache
    names = apply_checkpointing(model)
    assert names == [f"model.layers.{i}" for i in range(4)]
    assert model.config.use_cache is False
    remove_checkpointing(model)
    assert model.config.use_cache is True


# -- memory -------------------------------------------------------------------------------------------------
def test_full_checkpointing_cuts_saved_bytes_at_least_10x_on_8_blocks():
    _, _, plain, wrapped = run_twice(gpt(dropout=0.0), gpt_step)
    ratio = plain.activation_bytes / wrapped.activation_bytes
    assert ratio >= 10, f"saved bytes {plain.activation_bytes} -> {wrapped.activation_bytes}: only {ratio:.1f}x"


def test_every_2_about_halves_saved_bytes():
    _, _, plain, wrapped = run_twice(gpt(dropout=0.0), gpt_step, every=2)
    ratio = wrapped.activation_bytes / plain.activation_bytes
    assert 0.4 <= ratio <= 0.6, f"every=2 kept {ratio:.2f} of the saved bytes ({wrapped.activation_bytes} bytes)"


def test_selective_keeps_more_than_full_and_less_than_none():
    model = gpt(dropout=0.0)
    _, _, plain, selective = run_twice(model, gpt_step, selective=("matmul", "attention"))
    _, _, _, full = run_twice(gpt(dropout=0.0), gpt_step)
    assert full.activation_bytes < selective.activation_bytes < plain.activation_bytes


def test_checkpointed_block_saves_exactly_its_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    outer = nn.ModuleList([model, copy.deepcopy(model)])
    apply_checkpointing(outer, blocks=["0", "1"])
    x = torch.randn(5, 32)
    report = measure(lambda: outer[1](outer[0](x)).sum(), model=outer)
    # Block 0 saves x (5 x 32 x 4 bytes); block 1 saves block 0's output (5 x 32 x 4 bytes).
    assert report.activation_bytes == 2 * 5 * 32 * 4


# -- selective checkpointing and the random generator ---------------------------------------------------------
_ATTENTION_WITH_DROPOUT = {
    # What the CUDA path dispatches (CPU SDPA with dropout falls back to ordinary, recomputed ops): each fused
    # kernel with dropout_p > 0 consumes Philox offsets, and returns the seed and offset it used.
    "flash": (torch.ops.aten._scaled_dot_product_flash_attention.default, lambda q, p: (q, q, q, p), {}),
    "efficient": (torch.ops.aten._scaled_dot_product_efficient_attention.default,
                  lambda q, p: (q, q, q, None, True, p), {}),
    "cudnn": (torch.ops.aten._scaled_dot_product_cudnn_attention.default, lambda q, p: (q, q, q, None, True, p), {}),
    "efficient, dropout_p by keyword": (torch.ops.aten._scaled_dot_product_efficient_attention.default,
                                        lambda q, p: (q, q, q, None, True), "dropout_p"),
}


@pytest.mark.parametrize("kernel", list(_ATTENTION_WITH_DROPOUT))
def test_selective_policy_recomputes_fused_attention_with_dropout_and_keeps_it_without(kernel):
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from memtrain.checkpointing import _keep_policy, _op_packets

    op, positional, keyword = _ATTENTION_WITH_DROPOUT[kernel]
    ops = _op_packets(("matmul", "attention"))
    q = torch.empty(1, 2, 8, 4, device="meta")

    def policy(p: float) -> CheckpointPolicy:
        args, kwargs = (positional(q, p), {}) if not keyword else (positional(q, p), {keyword: p})
        return _keep_policy(ops, SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs)

    assert policy(0.1) == CheckpointPolicy.MUST_RECOMPUTE, f"{op} with dropout_p=0.1 would skip its Philox draws"
    assert policy(0.0) == CheckpointPolicy.MUST_SAVE, f"{op} without dropout is the FLOPs worth keeping"


@pytest.mark.parametrize("op", [torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli_.float,
                                torch.ops.aten.rand_like.default], ids=str)
def test_selective_policy_recomputes_every_op_that_draws_random_numbers(op):
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from memtrain.checkpointing import _keep_policy, _op_packets

    ops = _op_packets(("matmul", "attention", "conv")) | {op.overloadpacket}  # even when asked to keep it
    x = torch.empty(4, 4, device="meta")
    args = (x, 0.1, True) if op is torch.ops.aten.native_dropout.default else (x, 0.5) if "bernoulli" in str(op) \
        else (x,)
    assert _keep_policy(ops, SelectiveCheckpointContext(is_recompute=False), op, *args) in (
        CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


_noisy_library = torch.library.Library("memtrain_test", "FRAGMENT")
_noisy_library.define("noisy_mm(Tensor x, Tensor w, float dropout_p) -> (Tensor, Tensor)",
                      tags=(torch.Tag.nondeterministic_seeded,))


@torch.library.impl(_noisy_library, "noisy_mm", "CPU")
def _noisy_mm(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    # A fused "matmul + dropout" kernel: it draws its mask from the generator inside, as flash attention does.
    mask = torch.empty_like(x @ w).bernoulli_(1 - dropout_p) / (1 - dropout_p)
    return (x @ w) * mask, mask


class _NoisyMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, dropout_p):
        out, mask = torch.ops.memtrain_test.noisy_mm(x, w, dropout_p)
        ctx.save_for_backward(x, w, mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, mask = ctx.saved_tensors
        g = grad * mask
        return g @ w.t(), x.t() @ g, None


class _NoisyBlock(nn.Module):
    """A kept kernel that draws random numbers, followed by an ordinary dropout."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = _NoisyMM.apply(torch.tanh(x), self.w, 0.3)
        return x + self.lin(torch.ops.aten.native_dropout(torch.tanh(y), 0.3, True)[0])


def test_a_kept_op_that_draws_random_numbers_is_recomputed_and_gradients_equal_plain_training_bitwise():
    """On CUDA a kept fused attention kernel with dropout is such an op: saved, it would not draw again in the
    recompute, and the dropout after it would get another mask. Here a CPU kernel of that kind stands in for it."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from memtrain.checkpointing import _keep_policy

    torch.manual_seed(0)
    plain = nn.Sequential(*[_NoisyBlock() for _ in range(3)])
    wrapped = copy.deepcopy(plain)
    keep = frozenset({torch.ops.memtrain_test.noisy_mm, torch.ops.aten.mm})
    context_fn = functools.partial(create_selective_checkpoint_contexts, functools.partial(_keep_policy, keep))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    plain(x).square().sum().backward()
    torch.manual_seed(5)
    h = x
    for block in wrapped:
        h = checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
    h.square().sum().backward()
    assert_grads_equal(plain, wrapped)


def test_the_meter_counts_what_selective_checkpointing_keeps_on_torch_without_op_output(monkeypatch):
    """torch 2.11's SelectiveCheckpointContext has no op_output (its policy runs before the op): the kept matmul
    and attention outputs must still be counted, by the bytes they hold."""
    import torch.utils.checkpoint as torch_checkpoint

    def step(model):
        return measure(lambda: gpt_step(model), model=model).activation_bytes

    def kept_output_bytes(model) -> int:
        """Bytes of the matmul and attention outputs inside the blocks of a plain forward (each storage once)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        from memtrain.checkpointing import _op_packets

        ops, inside, seen = _op_packets(("matmul", "attention")), [False], {}

        class Outputs(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if inside[0] and func.overloadpacket in ops:
                    for t in torch.utils._pytree.tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            seen[t.untyped_storage()._cdata] = t  # held: a freed storage's address is reused
                return out

        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
        with Outputs():
            gpt_step(model)
        return sum(t.untyped_storage().nbytes() for t in seen.values())

    full = gpt(dropout=0.0)
    apply_checkpointing(full)
    expected = step(full) + kept_output_bytes(gpt(dropout=0.0))

    class ContextOfTorch211:
        def __init__(self, *, is_recompute, op_output=None):
            self.is_recompute = is_recompute

    monkeypatch.setattr(torch_checkpoint, "SelectiveCheckpointContext", ContextOfTorch211)
    selective = gpt(dropout=0.0)
    apply_checkpointing(selective, selective=("matmul", "attention"))
    got = step(selective)
    assert got == expected, f"selective checkpointing measured {got / 2**20:.2f} MiB, expected {expected / 2**20:.2f} MiB"


# -- behaviour ----------------------------------------------------------------------------------------------
def test_no_double_wrapping_and_remove():
    model = gpt(n_layer=4)
    first = apply_checkpointing(model)
    second = apply_checkpointing(model, every=2)
    assert first == [f"blocks.{i}" for i in range(4)]
    assert second == ["blocks.0", "blocks.2"]
    assert checkpointed_blocks(model) == second
    forward = model.blocks[0].forward
    assert forward.original.__self__ is model.blocks[0], "a wrapped forward must not wrap another wrapped forward"
    assert remove_checkpointing(model) == second
    assert checkpointed_blocks(model) == [] and "forward" not in model.blocks[0].__dict__


def test_state_dict_names_unchanged():
    model = gpt(n_layer=2)
    keys = list(model.state_dict())
    apply_checkpointing(model)
    assert list(model.state_dict()) == keys


class KwargsBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, scale: float, mask=None, return_dict: bool = False):
        y = self.lin(x) * scale
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return {"out": y, "aux": (y.sum(), "tag")} if return_dict else (y, None, 3)


def test_kwargs_non_tensor_args_and_structured_outputs_pass_through():
    torch.manual_seed(0)
    blocks = nn.ModuleList([KwargsBlock(), KwargsBlock()])
    twin = copy.deepcopy(blocks)
    apply_checkpointing(twin)
    x = torch.randn(3, 8)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0] = True

    def run(m):
        y, none, three = m[0](x, scale=2.0, mask=mask)
        assert none is None and three == 3
        out = m[1](y, scale=0.5, return_dict=True)
        assert out["aux"][1] == "tag"
        (out["out"].sum() + out["aux"][0]).backward()

    run(blocks)
    run(twin)
    assert_grads_equal(blocks, twin)


class KeywordDropoutBlock(nn.Module):
    """Takes its tensors by keyword, as Hugging Face decoder layers are called (``layer(hidden_states=h, ...)``)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, *, hidden_states, mask, pair=None, scale: float = 1.0):
        y = self.drop(self.lin(hidden_states)) * mask * scale
        return y if pair is None else y + pair[0] * pair[1]


def test_keyword_tensors_reach_checkpoints_device_rng_bookkeeping(monkeypatch):
    """torch stashes the RNG state of the devices of checkpoint's *positional* tensors only: a block given its
    tensors by keyword would recompute with other dropout masks on a GPU. Pretend a device module is initialised
    (as CUDA is on a GPU machine) so that checkpoint asks for device states on the CPU too, and spy on which
    tensors it looks at."""
    import types

    import torch.utils.checkpoint as torch_checkpoint

    seen: list[list[torch.Tensor]] = []
    real_states = torch_checkpoint.get_device_states

    def spy(*args):
        seen.append([t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)])
        return real_states(*args)

    initialised = types.SimpleNamespace(_initialized=True, **{k: getattr(torch.cpu, k) for k in dir(torch.cpu)
                                                              if not k.startswith("__")})
    monkeypatch.setattr(torch_checkpoint, "get_device_states", spy)
    monkeypatch.setattr(torch_checkpoint, "_get_device_module", lambda device="cuda": initialised)
    torch.manual_seed(0)
    blocks = nn.ModuleList([KeywordDropoutBlock(), KeywordDropoutBlock()])
    twin = copy.deepcopy(blocks)
    apply_checkpointing(twin)
    h = torch.randn(4, 16, requires_grad=True)
    mask, pair = torch.ones(4, 16), (torch.randn(4, 16), torch.randn(4, 16))

    def run(m):
        torch.manual_seed(3)
        y = m[0](hidden_states=h, mask=mask, scale=2.0)
        m[1](hidden_states=y, mask=mask, pair=pair).square().sum().backward()

    run(blocks)
    run(twin)
    assert_grads_equal(blocks, twin)
    assert len(seen) == 2, f"checkpoint asked for device states {len(seen)} times, expected once per block"
    for name, t in (("hidden_states", h), ("mask", mask), ("pair[0]", pair[0]), ("pair[1]", pair[1])):
        assert any(s is t for s in seen[0] + seen[1]), f"checkpoint never saw the keyword tensor {name}"
    assert any(s is h for s in seen[0]), "block 0's hidden_states (a keyword) was not among checkpoint's tensors"


def test_gradients_flow_when_no_input_requires_grad():
    """Frozen embeddings / PEFT: the block's input does not require grad, its parameters do."""
    model = gpt(n_layer=2, dropout=0.0)
    model.wte.weight.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    twin = copy.deepcopy(model)
    apply_checkpointing(twin)
    gpt_step(model).backward()
    gpt_step(twin).backward()
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        if a.requires_grad:
            assert b.grad is not None and torch.equal(a.grad, b.grad), name


class LoRA(nn.Module):
    """A frozen Linear plus a trainable low-rank adapter, as PEFT's LoRA wraps it."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # PEFT starts B at zero; non-zero, so that A gets gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_lora_adapters_get_the_same_gradients_with_every_input_and_weight_frozen(autocast):
    """No block input requires grad (frozen embeddings) and every base weight is frozen: only the adapters
    inside the checkpointed blocks train, and their gradients equal plain training's."""
    model = small_gpt(n_layer=3)
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv, block.mlp.fc = LoRA(block.attn.qkv), LoRA(block.mlp.fc)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    plain, wrapped, _, _ = run_twice(model, lambda m: _with(amp, lambda: gpt_step(m)))
    trainable = [n for n, p in plain.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable), trainable
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        if a.requires_grad:
            assert a.grad is not None and b.grad is not None, name
            diff = (a.grad - b.grad).abs().max().item()
            assert torch.equal(a.grad, b.grad), f"{name}: gradients differ, max abs diff {diff:.3e}"
        else:
            assert a.grad is None and b.grad is None, name


def _with(context, fn):
    with context:
        loss = fn()
    return loss


def test_no_checkpointing_under_no_grad():
    model = gpt(n_layer=2)
    apply_checkpointing(model)
    with torch.no_grad():
        out = model(torch.randint(0, 256, (1, 8)))
    assert out.shape == (1, 8, 256)


def test_block_selectors():
    model = gpt(n_layer=4)
    from memtrain.models import MLP, Block

    assert apply_checkpointing(model, blocks=Block) == [f"blocks.{i}" for i in range(4)]
    assert apply_checkpointing(model, blocks=(MLP,)) == [f"blocks.{i}.mlp" for i in range(4)]
    assert apply_checkpointing(model, blocks=lambda name, m: name.endswith("attn")) == [
        f"blocks.{i}.attn" for i in range(4)
    ]
    assert apply_checkpointing(model, blocks=["blocks.1", "blocks.3"]) == ["blocks.1", "blocks.3"]


def test_resnet_blocks_auto_detected():
    names = apply_checkpointing(ResNet(layers=(2, 1, 1, 1), width=4))
    assert names == ["layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0"]


def _mlp_blocks(n: int = 4, width: int = 16) -> list[nn.Sequential]:
    return [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * width, width))
            for _ in range(n)]


class MLPStack(nn.Module):
    """Blocks written as plain nn.Sequential (no block class), and a head of the blocks' leaf class."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(_mlp_blocks(4, width))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.mark.parametrize("build", [lambda: nn.Sequential(*_mlp_blocks()), MLPStack], ids=["sequential", "modulelist"])
def test_identical_sequential_blocks_detected_with_equal_gradients(build):
    torch.manual_seed(0)
    model = build()
    names = apply_checkpointing(copy.deepcopy(model))
    prefix = "layers." if isinstance(model, MLPStack) else ""
    assert names == [f"{prefix}{i}" for i in range(4)], names
    x = torch.randn(8, 16)
    plain, wrapped, plain_report, wrapped_report = run_twice(model, lambda m: m(x).square().sum())
    assert_grads_equal(plain, wrapped)
    assert wrapped_report.activation_bytes < plain_report.activation_bytes, (
        f"saved bytes {plain_report.activation_bytes} -> {wrapped_report.activation_bytes}")


def test_a_head_of_the_blocks_leaf_class_is_not_wrapped():
    """The "same kind outside the container" rule is for composite blocks (a ResNet stage of one block); a lone
    nn.Linear head of the same class as leaf blocks would recompute a matmul to save nothing."""

    class LinearStack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    assert apply_checkpointing(LinearStack()) == ["layers.0", "layers.1", "layers.2"]
    assert apply_checkpointing(MLPStack()) == [f"layers.{i}" for i in range(4)]


def test_sequentials_that_differ_are_not_blocks_and_the_error_says_what_was_found():
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.GELU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    with pytest.raises(ConfigError, match="no repeated blocks") as e:
        apply_checkpointing(model)
    message = str(e.value)
    assert "structurally identical" in message, message
    assert "the model itself is the largest container; it holds Sequential(Linear, GELU), Sequential(Linear, ReLU)" in message, message


# -- bad input ----------------------------------------------------------------------------------------------
def test_blocks_matching_nothing():
    with pytest.raises(ConfigError, match="matches no submodule"):
        apply_checkpointing(gpt(n_layer=2), blocks=nn.Conv2d)
    with pytest.raises(ConfigError, match="no submodule named 'blocks.9'"):
        apply_checkpointing(gpt(n_layer=2), blocks=["blocks.9"])
    with pytest.raises(ConfigError, match="no repeated blocks"):
        apply_checkpointing(nn.Linear(3, 3))


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_bad_every(every):
    with pytest.raises(ConfigError, match="every="):
        apply_checkpointing(gpt(n_layer=2), every=every)


def test_unknown_policy():
    with pytest.raises(ConfigError, match="unknown op kinds"):
        apply_checkpointing(gpt(n_layer=2), selective=("softmax",))
    with pytest.raises(ConfigError, match="not a policy"):
        apply_checkpointing(gpt(n_layer=2), selective=3)


def test_model_without_parameters():
    with pytest.raises(ConfigError, match="no parameters"):
        apply_checkpointing(nn.Sequential(nn.ReLU(), nn.ReLU()))


def test_module_already_wrapped_by_torch_checkpoint_wrapper():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = gpt(n_layer=2)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with pytest.raises(ConfigError, match="checkpoint_wrapper"):
        apply_checkpointing(model)


def test_hugging_face_checkpointing_already_enabled():
    model = _hf_llama()
    model.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable"):
        apply_checkpointing(model)


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        apply_checkpointing(gpt(n_layer=2), every=0, selective=("nope",), blocks=["missing"])
    assert len(info.value.problems) == 3, info.value.problems


def test_checkpoint_sequential_bad_segments():
    with pytest.raises(ConfigError, match="segments"):
        checkpoint_sequential(nn.Sequential(nn.Linear(2, 2)), 3, torch.randn(1, 2))


def test_a_selectively_checkpointed_model_saves_and_loads_whole():
    """torch.save(model) pickles the wrapped forwards (the op set of a selective policy is rebuilt on load); a
    policy given as a list works like a tuple."""
    import io

    from memtrain import SelectivePolicy

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16))
    apply_checkpointing(model, selective=SelectivePolicy(keep=["matmul"]))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(loaded(x, x), model(x, x), rtol=0, atol=0)
    assert checkpointed_blocks(loaded) == ["blocks.0", "blocks.1"]


_OFFLOADING_POLICIES = {
    "offload=True": dict(offload=True),
    "every2+offload": dict(every=2, offload=True),
    "selective+offload": dict(selective=("matmul",), offload=True),
    "offload blocks": dict(policies={f"blocks.{i}": "offload" for i in range(4)}),
    "keep/recompute/offload": dict(policies={"blocks.0": "offload", "blocks.1": "keep"}, offload=True),
}


def _copy_model(model: nn.Module, how: str) -> nn.Module:
    import io
    import pickle

    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
@pytest.mark.parametrize("policy", list(_OFFLOADING_POLICIES), ids=list(_OFFLOADING_POLICIES))
def test_a_model_with_an_offloader_saves_loads_and_trains_with_the_same_gradients(policy, how):
    """The offloader (a lock, a side stream, pinned slabs, a step's records) is pickled as its settings and built
    fresh on load; a deep copy shares it (a runtime resource, as estimate's meta copy needs)."""
    from memtrain.offload import ActivationOffloader, CpuTransport

    model = small_gpt(n_layer=4)
    offloader = ActivationOffloader(CpuTransport(), min_bytes=1, host_budget_bytes=2**24, slab_bytes=2**16)
    names = apply_checkpointing(model, offloader=offloader, **_OFFLOADING_POLICIES[policy])

    def step(m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        gpt_step(m).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    step(model)  # the offloader now holds a pool and a recorded order
    assert offloader.stats().offloaded_bytes > 0, "nothing offloaded: the test would prove nothing"
    loaded = _copy_model(model, how)
    assert checkpointed_blocks(loaded) == names
    offloaders = {id(m.forward.spec.offloader) for m in loaded.modules() if "forward" in m.__dict__}
    assert len(offloaders) == 1, "the loaded blocks must share one offloader"
    loaded_offloader = next(m.forward.spec.offloader for m in loaded.modules() if "forward" in m.__dict__)
    if how == "deepcopy":
        assert loaded_offloader is offloader
    else:
        assert loaded_offloader is not offloader and loaded_offloader.enabled
        assert loaded_offloader.stats().offloaded_bytes == 0 and loaded_offloader.pool.reserved_bytes == 0
    expected = step(model)
    got = step(loaded)
    for name in expected:
        diff = (got[name] - expected[name]).abs().max().item()
        assert torch.equal(got[name], expected[name]), f"{name}: the loaded model's gradient differs by {diff:.3e}"
    assert loaded_offloader.stats().offloaded_bytes > 0


def test_a_model_with_the_cpu_only_offloader_pickles(monkeypatch):
    """Without CUDA, offload=True builds a disabled offloader: it pickles too."""
    import memtrain.offload as offload_mod

    monkeypatch.setattr(offload_mod, "_NOOP_WARNED", True)
    model = small_gpt(n_layer=2, dropout=0.0)
    apply_checkpointing(model, offload=True, policies={"blocks.1": "offload"})
    loaded = _copy_model(model, "torch.save")
    x = torch.randint(0, 256, (2, 64))
    torch.testing.assert_close(loaded(x, x), model(x, x), rtol=0, atol=0)


# -- the typed policy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["none", "all", "every:3", "selective", "selective(matmul)",
                                   "selective(matmul,attention,conv)", "blocks(RRKO)", "all+offload",
                                   "every:2+offload", "blocks(ROK)+offload", True, False, None, 4])
def test_checkpointing_parse_round_trips_its_str(value):
    from memtrain.checkpointing import Checkpointing

    policy = Checkpointing.parse(value)
    assert Checkpointing.parse(str(policy)) == policy, (value, str(policy))
    assert Checkpointing.parse(policy) is policy
    hash(policy)  # a frozen, hashable value: plans compare and cache them


def test_checkpointing_parse_spellings():
    from memtrain.checkpointing import Checkpointing, SelectivePolicy

    assert Checkpointing.parse(" Every:2 ") == Checkpointing(mode="every", every=2)
    assert Checkpointing.parse(True) == Checkpointing() == Checkpointing(mode="all")
    assert Checkpointing.parse(None) == Checkpointing.parse(False) == Checkpointing(mode="none")
    assert Checkpointing.parse("selective") == Checkpointing(mode="selective", selective=SelectivePolicy())
    assert Checkpointing.parse("blocks(rko)").blocks == ("recompute", "keep", "offload")
    assert Checkpointing.parse("all+offload").offload_inputs
    assert str(Checkpointing(mode="selective", selective=SelectivePolicy(keep=["matmul"]))) == "selective(matmul)"


_POLICY_CASES = {
    "none": ({}, "none"),
    "all": ({}, "all"),
    "every:3": ({"every": 3}, "every:3"),
    "selective": ({"selective": ("matmul",)}, "selective(matmul)"),
    "blocks": ({"policies": {"blocks.0": "offload", "blocks.1": "keep", "blocks.2": "recompute",
                             "blocks.3": "keep", "blocks.4": "offload"}}, "blocks(OKRKO)"),
    "all+offload": ({"offload": True}, "all+offload"),
    "blocks+offload": ({"policies": {f"blocks.{i}": p for i, p in enumerate("recompute keep offload keep recompute"
                                                                             .split())}, "offload": True},
                       "blocks(RKOKR)+offload"),
}


@pytest.mark.parametrize("case", list(_POLICY_CASES))
def test_checkpointing_apply_matches_apply_checkpointing(case):
    """Each mode configures the model exactly as the apply_checkpointing call it stands for, and its
    block_policies say what each block does."""
    from memtrain.checkpointing import Checkpointing
    from memtrain.offload import ActivationOffloader, CpuTransport

    kwargs, spelling = _POLICY_CASES[case]
    policy = Checkpointing.parse(spelling)
    by_policy, by_call = small_gpt(n_layer=5), small_gpt(n_layer=5)
    offloader = ActivationOffloader(CpuTransport(), min_bytes=1, host_budget_bytes=2**24, slab_bytes=2**16)
    apply_checkpointing(by_policy)  # "none" must remove what is there
    names = policy.apply(by_policy, offloader=offloader)
    expected = [] if case == "none" else apply_checkpointing(by_call, offloader=offloader, **kwargs)
    assert names == expected == checkpointed_blocks(by_policy), (names, expected)

    def specs(model):
        return {name: (m.forward.spec.policy, m.forward.spec.selective, m.forward.spec.offloader is not None)
                for name, m in model.named_modules() if name in checkpointed_blocks(model)}

    assert specs(by_policy) == specs(by_call)
    per_block = policy.block_policies(5)
    assert [f"blocks.{i}" for i, p in enumerate(per_block) if p != "keep"] == names, per_block
    assert [f"blocks.{i}" for i, p in enumerate(per_block) if p == "offload"] == [
        name for name, (kind, _, _) in specs(by_policy).items() if kind == "offload"]
    torch.manual_seed(1)
    gpt_step(by_policy).backward()
    torch.manual_seed(1)
    gpt_step(by_call).backward()
    assert_grads_equal(by_policy, by_call)


@pytest.mark.parametrize("value, match", [
    ("every:0", "every=0"), ("sometimes", "not a checkpointing policy"), (0, "must be >= 1"),
    (2.5, "not a checkpointing policy"), ("auto", "planner"), ("blocks(RX)", "'x' is not a block letter"),
    ("selective(softmax)", "unknown op kinds"), ("none+offload", "offload_inputs=True with mode='none'"),
])
def test_checkpointing_parse_errors_name_the_accepted_spellings(value, match):
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError, match=match) as e:
        Checkpointing.parse(value)
    if "not a checkpointing policy" in match:
        assert "'every:K'" in str(e.value) and "To resolve this error" in str(e.value), str(e.value)


def test_checkpointing_reports_every_problem_at_once():
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError) as e:
        Checkpointing(mode="all", every=2, selective=("matmul",), blocks=("keep", "swap"), offload_inputs="yes")
    assert len(e.value.problems) == 5, e.value.problems
    with pytest.raises(ConfigError, match="is not a checkpointing mode"):
        Checkpointing(mode="some")
    with pytest.raises(ConfigError, match="needs one policy per block"):
        Checkpointing(mode="blocks")
    with pytest.raises(ConfigError, match="names 3 blocks, but GPT has 2"):
        Checkpointing.parse("blocks(RKR)").apply(gpt(n_layer=2))
    with pytest.raises(ConfigError, match="names 3 blocks, not 4"):
        Checkpointing.parse("blocks(RKR)").block_policies(4)


# -- a per-block layout with nothing to lay out ---------------------------------------------------------------
def test_a_block_layout_on_a_model_without_detected_blocks_is_a_config_error():
    from memtrain.checkpointing import Checkpointing

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # no repeated blocks
    policy = Checkpointing.parse("blocks(RK)")
    for call in (lambda: policy.arguments(model), lambda: policy.apply(model)):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert "blocks(RK)" in message and "no repeated blocks" in message and "To resolve this error" in message, (
            message)


@pytest.mark.parametrize("spelling, fragment", [("blocks", "a letter per block"), ("blocks()", "a letter per block"),
                                                ("blocks(RXK)", "'x'")])
def test_a_block_layout_spelling_without_valid_letters_names_the_spelling(spelling, fragment):
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError) as info:
        Checkpointing.parse(spelling)
    message = str(info.value)
    assert fragment in message and "blocks(RRK)" in message and "To resolve this error" in message, message


def test_mode_blocks_without_policies_names_the_spelling():
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError, match=r"blocks\(RRK\)"):
        Checkpointing(mode="blocks")


def test_an_empty_explicit_block_list_is_refused_not_silently_ignored():
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    for empty in ([], ()):
        with pytest.raises(ConfigError, match="blocks=.*selects no module.*To resolve this error"):
            apply_checkpointing(model, blocks=empty)
    assert checkpointed_blocks(model) == []
