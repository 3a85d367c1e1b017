"""The checkpointed forward of a block: parity (bitwise, fp32, CPU) with plain training, RNG, BatchNorm,
keyword and frozen inputs, and a wrapped model that saves, loads and pickles."""

from __future__ import annotations

import copy

import pytest
import torch
from checkpointing_parity import assert_buffers_equal, assert_grads_equal, gpt, gpt_step, hf_llama, run_twice
from helpers import tiny_gpt
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain import (
    apply_checkpointing,
    measure,
    remove_checkpointing,
)
from memtrain.checkpointing import checkpointed_blocks
from memtrain.models import GPT, GPTConfig, ResNet


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



def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)



def hf_step(model) -> torch.Tensor:
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    return model(input_ids=x, labels=x).loss



@pytest.mark.parametrize("build", [hf_llama, _hf_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("kwargs", [{}, {"every": 2}, {"selective": ("matmul",)}], ids=["all", "every2", "selective"])
def test_hugging_face_models_gradients_bitwise_equal(build, kwargs):
    model = build()
    model.train()
    plain, wrapped, plain_report, wrapped_report = run_twice(model, hf_step, **kwargs)
    assert_grads_equal(plain, wrapped)
    assert wrapped_report.activation_bytes < plain_report.activation_bytes



def test_hugging_face_blocks_detected_and_use_cache_switched_off():
    model = hf_llama()
    assert model.config.use_cache
    names = apply_checkpointing(model)
    assert names == [f"model.layers.{i}" for i in range(4)]
    assert model.config.use_cache is False
    remove_checkpointing(model)
    assert model.config.use_cache is True



def test_checkpointed_block_saves_exactly_its_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    outer = nn.ModuleList([model, copy.deepcopy(model)])
    apply_checkpointing(outer, blocks=["0", "1"])
    x = torch.randn(5, 32)
    report = measure(lambda: outer[1](outer[0](x)).sum(), model=outer)
    # Block 0 saves x (5 x 32 x 4 bytes); block 1 saves block 0's output (5 x 32 x 4 bytes).
    assert report.activation_bytes == 2 * 5 * 32 * 4



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
    model = tiny_gpt(3, seq_len=64, dropout=0.1, seed=0)
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



def test_a_selectively_checkpointed_model_saves_and_loads_whole():
    """torch.save(model) pickles the wrapped forwards (the op set of a selective policy is rebuilt on load); a
    policy given as a list works like a tuple."""
    import io

    from memtrain.checkpointing import SelectivePolicy

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

    model = tiny_gpt(4, seq_len=64, dropout=0.1, seed=0)
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
    import memtrain.offload.transport as transport_mod

    monkeypatch.setattr(transport_mod, "_NOOP_WARNED", True)
    model = tiny_gpt(2, seq_len=64, dropout=0.0, seed=0)
    apply_checkpointing(model, offload=True, policies={"blocks.1": "offload"})
    loaded = _copy_model(model, "torch.save")
    x = torch.randint(0, 256, (2, 64))
    torch.testing.assert_close(loaded(x, x), model(x, x), rtol=0, atol=0)
