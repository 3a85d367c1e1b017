"""The offloader on the CPU: gradients identical through host copies, what stays on the device, one copy
per storage, prefetch order, and apply_checkpointing's offloaded inputs and per-block policies."""

from __future__ import annotations

import contextlib

import pytest
import torch
from offload_stream_model import (
    Chain,
    FakeTransport,
    assert_same_grads,
    chain_step,
    gpt_step,
    grads,
    offloader,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

import memtrain.offload.transport as transport_mod
from memtrain.checkpointing import apply_checkpointing, remove_checkpointing
from memtrain.errors import ConfigError
from memtrain.models import GPT, GPTConfig
from memtrain.offload import ActivationOffloader


def test_gpt_gradients_identical_through_host_copies():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, seq_len=32, dropout=0.1))
    idx = torch.randint(0, 256, (2, 32))
    torch.manual_seed(1)
    expected = gpt_step(model, idx)
    transport = FakeTransport(lag=4)
    off = offloader(transport, model=model, include_logits=True)
    for _ in range(2):  # the second step reuses the pool and the recorded order
        torch.manual_seed(1)
        assert_same_grads(gpt_step(model, idx, off), expected)
    stats = off.stats()
    assert stats.offloaded_tensors > 20 and stats.offloaded_bytes > 0, stats
    assert stats.prefetched > 0 and stats.learned_order_used == 1, stats
    assert transport.tags("h2d"), "nothing came back from the host: the test would prove nothing"
    assert stats.host_used_bytes == 0, f"{stats.host_used_bytes} host bytes still held after backward"


def test_hugging_face_llama_gradients_identical():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 24))

    def step(context=None):
        model.zero_grad(set_to_none=True)
        if context is None:
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            with context:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return grads(model)

    expected = step()
    transport = FakeTransport(lag=2)
    off = offloader(transport, model=model)
    assert_same_grads(step(off), expected)
    assert off.stats().offloaded_tensors > 10 and off.stats().deduplicated > 0, off.stats()
    # One storage saved by q, k and v projections: its three saved tensors die one by one during backward, and
    # it must still come back once, not once more for the last of them.
    h2d = transport.tags("h2d")
    assert len(h2d) == len(set(h2d)), f"records fetched twice: {sorted(h2d)}"


def test_saved_tensors_read_twice_by_one_node():
    class ReadsTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, _ = ctx.saved_tensors
            _, b = ctx.saved_tensors  # a second unpack of the same saved tensors
            return g * b, g * a

    leaf = torch.randn(16, 16, requires_grad=True)
    transport = FakeTransport(lag=1)
    with offloader(transport):
        a = leaf.exp()
        loss = ReadsTwice.apply(a, a * 3).sin().sum()
    loss.backward()
    expected = leaf.grad.clone()
    leaf.grad = None
    a = leaf.exp()
    ReadsTwice.apply(a, a * 3).sin().sum().backward()
    assert torch.equal(leaf.grad, expected), (leaf.grad - expected).abs().max()
    h2d = transport.tags("h2d")
    assert len(h2d) == len(set(h2d)), f"records fetched twice: {h2d}"


def test_retain_graph_second_backward_fetches_again():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(4, 8)
    model(x).sum().backward(retain_graph=False)
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    with offloader(FakeTransport(lag=2)):
        out = model(x).sum()
    out.backward(retain_graph=True)
    first = grads(model)
    model.zero_grad(set_to_none=True)
    out.backward()
    assert_same_grads(first, expected)
    assert_same_grads(grads(model), expected)


def test_every_backward_of_a_retained_graph_prefetches():
    """The second backward of a graph kept with retain_graph fetches what the first fetched, ahead of use too."""
    torch.manual_seed(0)
    model = Chain(widths=tuple(range(8, 8 + 4 * 9, 4)))  # 9 storages saved
    x = torch.randn(4, 8)
    model(x).sum().backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    off = offloader(FakeTransport(lag=0), prefetch_depth=2)  # copies done at once: every record comes back
    with off:
        out = model(x).sum()
    out.backward(retain_graph=True)
    first = off.stats()
    model.zero_grad(set_to_none=True)
    out.backward()
    second = off.stats()
    assert_same_grads(grads(model), expected)
    prefetched = (first.prefetched, second.prefetched - first.prefetched)
    on_demand = (first.fetched_on_demand, second.fetched_on_demand - first.fetched_on_demand)
    assert prefetched[0] > 0 and prefetched[1] == prefetched[0], f"prefetched per pass {prefetched}, on demand {on_demand}"
    assert on_demand[1] == on_demand[0], f"fetched on demand per pass {on_demand}"


def _saves(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    h = lin(x)  # saves x (4096 bytes)
    y = h * lin.scale  # saves the buffer (4096)
    z = y.sin()  # saves y (4096)
    u = nn.functional.linear(z, lin.weight)  # saves z (4096) and weight.t(), a view of a parameter (4096)
    return u.exp().sum() + u[:2].exp().sum()  # saves exp's results: 4096 and 256 bytes


def test_threshold_parameters_and_buffers_stay():
    lin = nn.Linear(32, 32)
    lin.register_buffer("scale", torch.full((32, 32), 2.0))
    x = torch.randn(32, 32)
    transport = FakeTransport(lag=0)
    with offloader(transport, model=lin, min_bytes=4096) as off:
        loss = _saves(lin, x)
    sizes = [n for kind, _, n in (e for e in transport.log if e[0] == "d2h")]
    assert sizes == [4096] * 4, f"offloaded storages of {sizes} bytes (x, y, z, exp)"
    kept = dict(off.stats().kept)
    assert kept == {"parameter": 2, "small": 1}, kept
    loss.backward()
    # Without the model the buffer is indistinguishable from an activation; one byte more and nothing moves.
    for kwargs, expected in (({"min_bytes": 4096}, 5), ({"model": lin, "min_bytes": 4097}, 0)):
        transport = FakeTransport(lag=0)
        with offloader(transport, **kwargs):
            _saves(lin, x).backward()
        assert len(transport.tags("d2h")) == expected, (kwargs, transport.log)


def test_bare_leaf_tensors_and_casts_of_them_are_parameters():
    w = torch.randn(64, 64, requires_grad=True)  # a parameter that is not an nn.Parameter
    x = torch.randn(64, 64)
    transport = FakeTransport(lag=0)
    with offloader(transport) as off:
        h = x @ w.t()  # saves x
        y = h @ w.double().float()  # saves h and a cast of w
    assert len(transport.tags("d2h")) == 2, transport.log
    assert dict(off.stats().kept) == {"parameter": 1}, off.stats().kept
    y.sum().backward()
    expected = w.grad.clone()
    w.grad = None
    ((x @ w.t()) @ w.double().float()).sum().backward()
    assert torch.equal(w.grad, expected)


def test_same_storage_moves_once():
    x0 = torch.randn(32, 32, requires_grad=True)

    def loss_of(x0: torch.Tensor) -> torch.Tensor:
        x = x0 * 2  # 4096 bytes
        a = x.sin()  # saves x
        b = x.view(16, 64).cos()  # saves a view of x
        c = a * x  # saves x again (and a)
        return b.sum() + c.sum()

    loss_of(x0).backward()
    expected = x0.grad.clone()
    x0.grad = None
    transport = FakeTransport(lag=1)
    with offloader(transport) as off:
        loss = loss_of(x0)
    stats = off.stats()
    assert len(transport.tags("d2h")) == 2 and stats.deduplicated == 2, (transport.log, stats)
    assert stats.offloaded_bytes == 2 * 4096 and stats.offloaded_tensors == 4, stats
    loss.backward()
    assert torch.equal(x0.grad, expected), (x0.grad - expected).abs().max()


def test_logits_stay_on_device_by_default():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, vocab_size=256)
    model = GPT(config)
    idx = torch.randint(0, 256, (2, 16))
    logits_bytes = 2 * 16 * 256 * 4
    for include, expect_logits in ((False, False), (True, True)):
        transport = FakeTransport(lag=0)
        with offloader(transport, model=model, include_logits=include):
            loss = model(idx, idx)
        loss.backward()
        moved = [n for kind, _, n in (e for e in transport.log if e[0] == "d2h")]
        assert (logits_bytes in moved) == expect_logits, f"include_logits={include}: moved {moved}"


def test_checkpointed_blocks_offload_exactly_their_inputs():
    """Non-reentrant checkpoint saves the block inputs through the outer hooks, and nothing else."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, seq_len=16))
    idx = torch.randint(0, 256, (3, 16))
    expected = gpt_step(model, idx)
    transport = FakeTransport(lag=1)
    off = offloader(transport)
    originals = [block.forward for block in model.blocks]
    try:
        for block, original in zip(model.blocks, originals, strict=True):
            block.forward = off.wrap(lambda x, f=original: checkpoint(f, x, use_reentrant=False))
        got = gpt_step(model, idx)
    finally:
        for block in model.blocks:
            del block.forward
    assert_same_grads(got, expected)
    block_input = 3 * 16 * 32 * 4
    moved = [n for kind, _, n in (e for e in transport.log if e[0] == "d2h")]
    assert moved == [block_input] * 4, f"moved {moved}, expected four block inputs of {block_input} bytes"


class LoRALinear(nn.Module):
    """A frozen base Linear plus a small trainable low-rank adapter, as PEFT's LoRA builds it."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # PEFT starts B at zero; non-zero, so that A gets gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRABlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width).requires_grad_(False)
        self.up = LoRALinear(width, 3 * width)
        self.down = LoRALinear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class LoRANet(nn.Module):
    """Frozen embedding, blocks with frozen base weights and trainable adapters, a frozen head."""

    def __init__(self, width: int = 40, vocab: int = 50, n_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width).requires_grad_(False)
        self.blocks = nn.ModuleList(LoRABlock(width) for _ in range(n_blocks))
        self.head = nn.Linear(width, vocab).requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), idx.flatten())


class RecordingTransport(FakeTransport):
    """Keeps the bytes of every copy to the host, to tell what crossed the link."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.moved: list[torch.Tensor] = []

    def copy_to_host(self, src, segments, tag):
        self.moved.append(src.clone())  # the CPU has written src already
        return super().copy_to_host(src, segments, tag)


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
@pytest.mark.parametrize("how", ["whole model", "offload blocks"])
def test_frozen_weights_their_views_and_casts_stay_on_the_device(how, autocast):
    """LoRA: the frozen base weights (and, under autocast, their bf16 copies, made afresh at every use) are saved
    for backward as operands of the adapters' inputs' gradients; moving them would cross the link twice a step
    for bytes that are on the device anyway."""
    torch.manual_seed(0)
    model = LoRANet()
    idx = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

    def step(context=None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with amp, (context or contextlib.nullcontext()):
            loss = model(idx)
        loss.backward()
        return grads(model)

    expected = step()
    assert expected and all("lora" in n for n in expected), sorted(expected)
    transport = RecordingTransport(lag=2)
    if how == "whole model":
        off = offloader(transport, model=model, include_logits=True)
        got = step(off)
    else:  # apply_checkpointing's per-block contexts: the offloader is not given the model
        off = offloader(transport)
        apply_checkpointing(model, policies={f"blocks.{i}": "offload" for i in range(3)}, offloader=off)
        got = step()
        remove_checkpointing(model)
    assert_same_grads(got, expected)
    frozen = [p.detach() for p in model.parameters() if not p.requires_grad and p.dim() == 2]
    copies = [w.to(dtype).contiguous().view(torch.uint8).flatten() for w in frozen
              for dtype in (torch.float32, torch.bfloat16)]
    crossed = [m for m in transport.moved if any(m.numel() == c.numel() and torch.equal(m, c) for c in copies)]
    assert not crossed, (f"{len(crossed)} frozen weights or copies of them ({sum(m.numel() for m in crossed)} bytes)"
                         f" crossed the link, out of {sum(m.numel() for m in transport.moved)} bytes moved")
    assert off.stats().offloaded_bytes > 0, "no activation moved: the test would prove nothing"


def test_prefetch_in_reverse_order_depth_ahead():
    torch.manual_seed(0)
    model = Chain(widths=tuple(range(8, 8 + 4 * 9, 4)))  # 8 layers: 9 storages saved (input + tanh outputs)
    x = torch.randn(4, 8)
    for depth in (1, 3):
        transport = FakeTransport(lag=0)
        with offloader(transport, prefetch_depth=depth):
            out = model(x).sum()
        n = len(transport.tags("d2h"))
        out.backward()
        # Every copy is done at once (lag 0), so every device copy was freed and everything comes back.
        assert transport.tags("h2d") == list(range(n - 1, -1, -1)), f"depth {depth}: {transport.log}"
        # When backward first waits for record i, exactly records i ... i+1-depth have been asked for (the
        # last one, needed first, on demand).
        issued: list[int] = []
        waited: set[int] = set()
        for entry in transport.log:
            if entry[0] == "h2d":
                issued.append(entry[1])
            elif entry[0] == "wait" and entry[1] == "h2d" and entry[2] not in waited:
                i = entry[2]
                waited.add(i)
                lowest = i if i == n - 1 else max(i + 1 - depth, 0)
                assert issued == list(range(n - 1, lowest - 1, -1)), (depth, i, issued)
        assert waited == set(range(n)), waited


def test_learned_order_replaces_reverse_order():
    """A node unpacks its saved tensors first-to-last: reverse order guesses wrong, the recorded order not."""

    class SavesThree(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            ctx.save_for_backward(a, b, c)
            return a * b * c

        @staticmethod
        def backward(ctx, g):
            a, b, c = ctx.saved_tensors
            return g * b * c, g * a * c, g * a * b

    leaf = torch.randn(3, 64, requires_grad=True)
    transport = FakeTransport(lag=1)  # the last copy is still in flight when backward starts
    off = offloader(transport, prefetch_depth=1)
    on_demand = []
    for _ in range(2):
        before = off.stats().fetched_on_demand
        with off:
            a, b, c = (leaf * (i + 1.0) for i in range(3))
            out = SavesThree.apply(a, b, c)
            tail = out.sin().sum()  # one more record, still on the device when backward starts
        tail.backward()
        on_demand.append(off.stats().fetched_on_demand - before)
    # Reverse order prefetches c while a is needed first; the recorded order (a, b, c) has each one ready.
    assert on_demand == [2, 0], f"on-demand fetches per step: {on_demand}"
    assert off.stats().learned_order_used == 1 and off.stats().served_from_device == 2, off.stats()


@pytest.mark.parametrize("retain_graph", [False, True])
def test_nothing_offloaded_holds_device_memory_after_backward(retain_graph):
    """The optimizer step runs right after backward: no restored tensor nor copy source may still be on the
    device then (nothing calls into the offloader between backward and the step to release them)."""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    expected = chain_step(model, x)
    transport = FakeTransport(lag=3)
    off = offloader(transport, prefetch_depth=2)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with off:
            loss = model(x).square().sum()
        assert transport.live_device_bytes() > 0, "nothing on the device after forward: the test proves nothing"
        loss.backward(retain_graph=retain_graph)
        held = transport.live_device_bytes()
        assert held == 0, f"step {step}: {held} bytes of offloaded tensors still on the device after backward"
        assert_same_grads(grads(model), expected)
    if retain_graph:  # the host copies serve a second backward of the same graph
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert_same_grads(grads(model), expected)


def test_bad_arguments_are_reported_together():
    with pytest.raises(ConfigError) as e:
        ActivationOffloader(FakeTransport(), min_bytes=0, prefetch_depth=0, host_budget_bytes=-1)
    assert len(e.value.problems) == 3, e.value.problems


def test_apply_checkpointing_offload_moves_block_inputs_only():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, seq_len=16, dropout=0.1))
    idx = torch.randint(0, 256, (3, 16))
    torch.manual_seed(1)
    expected = gpt_step(model, idx)
    transport = FakeTransport(lag=1)
    wrapped = apply_checkpointing(model, offload=True, offloader=offloader(transport))
    torch.manual_seed(1)
    assert_same_grads(gpt_step(model, idx), expected)
    moved = [n for kind, _, n in (e for e in transport.log if e[0] == "d2h")]
    assert wrapped == [f"blocks.{i}" for i in range(4)] and moved == [3 * 16 * 32 * 4] * 4, moved
    remove_checkpointing(model)
    torch.manual_seed(1)
    assert_same_grads(gpt_step(model, idx), expected)


class KeywordBlock(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, *, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(hidden_states))


def test_apply_checkpointing_offload_moves_inputs_given_by_keyword():
    """A block called as ``block(hidden_states=h)`` (Hugging Face style): checkpoint saves only its positional
    tensors through the hooks and would hold keyword ones in a closure, on the device."""
    torch.manual_seed(0)
    model = nn.ModuleList([KeywordBlock() for _ in range(3)])
    x = torch.randn(8, 32)  # not a leaf that requires grad: those count as parameters and stay

    def step() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        h = x
        for block in model:
            h = block(hidden_states=h)
        h.sum().backward()
        return grads(model)

    expected = step()
    transport = FakeTransport(lag=1)
    apply_checkpointing(model, offload=True, offloader=offloader(transport))
    assert_same_grads(step(), expected)
    moved = [n for kind, _, n in (e for e in transport.log if e[0] == "d2h")]
    assert moved == [8 * 32 * 4] * 3, f"moved {moved}: expected the three blocks' keyword inputs of {8 * 32 * 4} bytes"


def test_per_block_keep_recompute_offload():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, seq_len=16))
    idx = torch.randint(0, 256, (3, 16))
    expected = gpt_step(model, idx)
    transport = FakeTransport(lag=2)
    off = offloader(transport, min_bytes=1024)
    wrapped = apply_checkpointing(model, policies={"blocks.0": "offload", "blocks.1": "keep"}, offloader=off)
    assert wrapped == ["blocks.0", "blocks.2", "blocks.3"], wrapped
    assert_same_grads(gpt_step(model, idx), expected)
    # blocks.0 keeps every activation on the host (no recompute): its input, LayerNorm outputs, qkv, MLP...
    assert len(transport.tags("d2h")) >= 6, transport.log
    with pytest.raises(ConfigError) as e:
        apply_checkpointing(model, policies={"blocks.9": "offload", "blocks.0": "swap"})
    assert len(e.value.problems) == 2, e.value.problems


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_apply_checkpointing_offload_without_cuda_is_a_noop(monkeypatch):
    monkeypatch.setattr(transport_mod, "_NOOP_WARNED", False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    idx = torch.randint(0, 256, (2, 16))
    expected = gpt_step(model, idx)
    with pytest.warns(UserWarning, match="does nothing"):
        apply_checkpointing(model, offload=True)
    assert_same_grads(gpt_step(model, idx), expected)


def test_forwards_without_backward_do_not_pile_up():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(4, 8)
    off = offloader(FakeTransport(lag=1))
    for _ in range(3):
        with off:
            model(x).sum()  # the graph is dropped at once: an evaluation with grad enabled
    assert len(off._epoch) <= 6 and off.stats().host_used_bytes == 0, (len(off._epoch), off.stats())
    with off:
        loss = model(x).sum()
    loss.backward()  # and training still works after it
