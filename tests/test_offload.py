"""Activation offload on the CPU: the pack / unpack / prefetch logic through a model of two CUDA streams.

``FakeTransport`` runs ``CudaTransport``'s own synchronisation logic over a model of the compute stream and the
side stream (see its docstring): a missing wait, ``wait_stream`` or ``record_stream``, or a source freed before
its copy ran, shows up as NaN gradients or as an error; it logs the copies in order so that what moves, when and
in which order can be checked.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import memtrain.offload as offload_mod
from memtrain.checkpointing import apply_checkpointing, remove_checkpointing
from memtrain.errors import ConfigError, MemtrainError
from memtrain.models import GPT, GPTConfig
from memtrain.offload import ActivationOffloader, CudaTransport, offload_activations

POISON = 255  # a byte that makes NaN of every float dtype


class FakeEvent:
    def __init__(self, kind: str, tag: int) -> None:
        self.kind, self.tag, self.done = kind, tag, False
        self.block: DeviceBlock | None = None  # the destination of a copy to the device


class DeviceBlock:
    """Device memory allocated on the side stream, as the caching allocator sees it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref = StorageWeakRef(tensor.untyped_storage())
        self.cdata = tensor.untyped_storage()._cdata
        self.nbytes = tensor.numel()
        self.read_by_compute = False  # the compute stream waited for its copy: it reads the block
        self.recorded = False  # record_stream(compute stream) was called on it


class FakeTransport(CudaTransport):
    """``CudaTransport``'s logic over a model of two CUDA streams on the CPU.

    - The compute stream is the CPU itself (its kernels are done at once) with a clock: it ticks at every call
      into the transport, since the offloader's caller computed in between; a tensor handed to ``copy_to_host``
      was written at the current tick.
    - The side stream runs its copies ``lag`` transfers after they are issued, in order. A copy to the host reads
      its source when it runs, holding it weakly (a queued kernel keeps no memory alive): it writes NaN bytes when
      the source died first, or when the side stream had not waited for the compute stream (``wait_stream``)
      since the source was written. A copy to the device fills its destination only when it runs (NaN before),
      so a missing wait on its event reads NaN.
    - Device memory allocated on the side stream and read by the compute stream must be ``record_stream``-ed to
      the compute stream before it is freed: otherwise the next allocation on the side stream may reuse it while
      the compute stream still reads it. The next allocation raises then.
    - ``refuse_pinning_after``: that many host slabs are pinned, then pinning fails (host memory exhausted).
    """

    def __init__(self, lag: int = 3, refuse_pinning_after: int | None = None):
        self.lag = lag
        self.refuse_pinning_after = refuse_pinning_after
        self.queue: collections.deque[tuple[list, FakeEvent]] = collections.deque()
        self.log: list[tuple] = []
        self.slabs = 0
        self.host_offsets: list[int] = []  # host address of each copy to the host, in order
        self.hazards: list[str] = []  # data races seen by the copies that ran
        self.clock = 0  # the compute stream's progress
        self.side_synced = 0  # the compute clock the side stream last waited for
        self.blocks: list[DeviceBlock] = []
        self.sources: list[tuple[weakref.ref, int]] = []  # the offloader's handle on each source, with its bytes
        self._ops: list = []  # side-stream copies issued since the last event
        self._transfer: tuple[str, int, int] = ("", -1, 0)  # (direction, tag, compute tick its source was written)
        self._block: DeviceBlock | None = None
        super().__init__(torch.device("cpu"))

    def __reduce__(self):  # a model holding this transport pickles as a fresh one
        return type(self), (self.lag, self.refuse_pinning_after)

    # -- what the offloader calls: log, and tick the compute clock
    def allocate_host(self, nbytes: int) -> torch.Tensor:
        self.clock += 1
        return super().allocate_host(nbytes)

    def copy_to_host(self, src, segments, tag):
        self.clock += 1
        self.log.append(("d2h", tag, src.numel()))
        self.host_offsets.append(segments[0][1].data_ptr())
        self._transfer = ("d2h", tag, self.clock)
        self.sources.append((weakref.ref(src), src.numel()))
        return super().copy_to_host(src, segments, tag)

    def copy_to_device(self, segments, nbytes, tag):
        self.clock += 1
        self.log.append(("h2d", tag, nbytes))
        self._transfer = ("h2d", tag, self.clock)
        return super().copy_to_device(segments, nbytes, tag)

    def wait(self, event) -> None:
        # The compute stream waits: the side stream must have reached the event.
        self.clock += 1
        self.log.append(("wait", event.kind, event.tag))
        super().wait(event)

    def query(self, event) -> bool:
        self.clock += 1
        return super().query(event)

    def hand_over(self, tensor) -> None:
        self.clock += 1
        super().hand_over(tensor)

    # -- the stream operations CudaTransport is built from
    def _new_stream(self):
        return "side"

    def _current(self):
        return "compute"

    def _pinned(self, nbytes: int) -> torch.Tensor:
        if self.refuse_pinning_after is not None and self.slabs >= self.refuse_pinning_after:
            raise RuntimeError("CUDA error: out of memory (FakeTransport refuses to pin more host memory)")
        self.slabs += 1
        self.log.append(("slab", nbytes))
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _empty(self, nbytes: int, stream) -> torch.Tensor:
        assert stream == "side", stream
        self._check_frees()
        dst = torch.full((nbytes,), POISON, dtype=torch.uint8)
        self._block = DeviceBlock(dst)
        self.blocks.append(self._block)
        return dst

    def _copy(self, dst, src, stream) -> None:
        assert stream == "side", stream
        direction, tag, written = self._transfer
        if direction == "h2d":
            self._ops.append(lambda: dst.copy_(src))
            return
        ordered = self.side_synced >= written
        ref, offset, n = StorageWeakRef(src.untyped_storage()), src.storage_offset(), src.numel()

        def run() -> None:
            if not ordered:
                self.hazards.append(f"d2h {tag}: read before the compute stream wrote it (no wait_stream)")
                dst.fill_(POISON)
            elif ref.expired():
                self.hazards.append(f"d2h {tag}: its source was freed before the copy ran")
                dst.fill_(POISON)
            else:
                storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
                dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, offset, (n,)))

        self._ops.append(run)

    def _wait_stream(self, stream, other) -> None:
        assert (stream, other) == ("side", "compute"), (stream, other)
        self.side_synced = self.clock

    def _record_event(self, stream):
        assert stream == "side", stream
        direction, tag, _ = self._transfer
        event = FakeEvent(direction, tag)
        event.block, self._block = (self._block if direction == "h2d" else None), None
        self.queue.append((self._ops, event))
        self._ops = []
        self._advance(self.lag)
        return event

    def _wait_event(self, stream, event) -> None:
        assert stream == "compute", stream
        while not event.done:
            self._advance(len(self.queue) - 1)
        if event.block is not None:
            event.block.read_by_compute = True

    def _query(self, event) -> bool:
        return event.done

    def _record_stream(self, tensor, stream) -> None:
        assert stream == "compute", stream
        key = tensor.untyped_storage()._cdata
        for block in self.blocks:
            if block.cdata == key and not block.ref.expired():
                block.recorded = True

    # -- the model's bookkeeping
    def _advance(self, keep: int) -> None:
        while len(self.queue) > keep:
            ops, event = self.queue.popleft()
            for op in ops:
                op()
            event.done = True

    def _check_frees(self) -> None:
        for block in [b for b in self.blocks if b.ref.expired()]:
            self.blocks.remove(block)
            if block.read_by_compute and not block.recorded:
                raise AssertionError(
                    f"a restored block of {block.nbytes} bytes was freed while the compute stream may still read it, "
                    "without record_stream: the side stream's next allocation could overwrite it")

    def live_device_bytes(self) -> int:
        """Bytes of device memory the offload still holds: restored blocks, and the sources of copies to the host
        that the offloader still references."""
        return (sum(b.nbytes for b in self.blocks if not b.ref.expired())
                + sum(n for ref, n in self.sources if ref() is not None))

    def tags(self, kind: str) -> list[int]:
        return [entry[1] for entry in self.log if entry[0] == kind]


def offloader(transport=None, **kwargs) -> ActivationOffloader:
    kwargs.setdefault("min_bytes", 1)
    kwargs.setdefault("host_budget_bytes", 2**24)
    kwargs.setdefault("slab_bytes", 2**16)
    return ActivationOffloader(transport or FakeTransport(), **kwargs)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert torch.equal(a[name], b[name]), f"{name}: max abs diff {diff}"


def gpt_step(model: GPT, idx: torch.Tensor, context=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if context is None:
        loss = model(idx, idx)
    else:
        with context:
            loss = model(idx, idx)
    loss.backward()
    return grads(model)


class Chain(nn.Module):
    """Layers of distinct widths, so every saved tensor has its own size: the copy log names them."""

    def __init__(self, widths: tuple[int, ...] = (8, 12, 16, 20, 24, 28)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))  # tanh saves its output: one more saved tensor per layer
        return x


# -- parity -------------------------------------------------------------------------------------------------
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


def test_a_missing_wait_corrupts_gradients():
    """The parity test can fail: skip the compute stream's wait and backward reads unfinished copies."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    idx = torch.randint(0, 256, (2, 16))
    expected = gpt_step(model, idx)

    class NoWait(FakeTransport):
        def wait(self, event) -> None:
            self.log.append(("wait",))

    got = gpt_step(model, idx, offloader(NoWait(lag=1000), model=model))
    assert any(not torch.equal(got[n], expected[n]) for n in expected), "gradients matched without waiting"


def _chain_step(model: nn.Module, x: torch.Tensor, off: ActivationOffloader | None = None) -> dict:
    model.zero_grad(set_to_none=True)
    if off is None:
        model(x).square().sum().backward()
    else:
        with off:
            loss = model(x).square().sum()
        loss.backward()
    return grads(model)


def test_sources_outlive_their_copies_to_the_host():
    """Copies lag far behind compute (8 transfers) and only one may be in flight: the offloader lets each source
    go only once its copy is done or the compute stream waits for it; no copy reads a freed source."""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    expected = _chain_step(model, x)
    transport = FakeTransport(lag=8)
    for _ in range(2):
        assert_same_grads(_chain_step(model, x, offloader(transport, prefetch_depth=1)), expected)
    assert transport.hazards == [], transport.hazards
    assert transport.tags("h2d"), "nothing came back from the host: the test would prove nothing"


@pytest.mark.parametrize("missing", ["release wait", "wait_stream", "record_stream"])
def test_the_stream_model_catches_a_missing_synchronisation(monkeypatch, missing):
    """The tests above can fail: without each synchronisation, gradients go wrong or the model of the caching
    allocator sees memory reused under the compute stream."""
    if missing == "release wait":  # _release_src dropping the source without the compute stream waiting
        monkeypatch.setattr(ActivationOffloader, "_release_src", lambda self, record: setattr(record, "src", None))
    elif missing == "wait_stream":
        monkeypatch.setattr(FakeTransport, "_wait_stream", lambda self, stream, other: None)
    else:
        monkeypatch.setattr(FakeTransport, "_record_stream", lambda self, tensor, stream: None)
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    expected = _chain_step(model, x)
    transport = FakeTransport(lag=8)
    try:
        got = _chain_step(model, x, offloader(transport, prefetch_depth=1))
    except AssertionError as e:
        assert "record_stream" in str(e), e
        return
    assert any(not torch.equal(got[n], expected[n]) for n in expected), f"{missing}: gradients matched"
    assert transport.hazards, f"{missing}: no hazard seen"


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


# -- what moves ---------------------------------------------------------------------------------------------
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


# -- order, prefetch, pool ----------------------------------------------------------------------------------
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


def test_pool_is_reused_every_step():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    transport = FakeTransport(lag=2)
    off = offloader(transport, slab_bytes=1024)  # small slabs: blocks span slab boundaries
    offsets = []
    for _ in range(3):
        start = len(transport.host_offsets)
        with off:
            loss = model(x).sum()
        loss.backward()
        offsets.append(transport.host_offsets[start:])
        assert off.stats().host_used_bytes == 0
    slabs_after_first = transport.slabs
    assert offsets[0] == offsets[1] == offsets[2], f"host blocks moved between steps: {offsets}"
    assert transport.slabs == slabs_after_first
    assert off.stats().host_reserved_bytes == transport.slabs * 1024


def test_host_budget_keeps_the_rest_on_device_and_warns_once():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    model(x).sum().backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    transport = FakeTransport(lag=1)
    off = offloader(transport, host_budget_bytes=2048, slab_bytes=1024)
    with pytest.warns(UserWarning, match="host budget") as record:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with off:
                loss = model(x).sum()
            loss.backward()
    assert len(record) == 1, [str(w.message) for w in record]
    assert_same_grads(grads(model), expected)
    stats = off.stats()
    assert stats.host_peak_used_bytes <= 2048 and stats.host_reserved_bytes <= 2048, stats
    assert stats.over_budget_bytes > 0 and stats.offloaded_bytes > 0, stats


@pytest.mark.parametrize("retain_graph", [False, True])
def test_nothing_offloaded_holds_device_memory_after_backward(retain_graph):
    """The optimizer step runs right after backward: no restored tensor nor copy source may still be on the
    device then (nothing calls into the offloader between backward and the step to release them)."""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    expected = _chain_step(model, x)
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


def test_a_pinning_failure_mid_forward_keeps_tensors_on_the_device_with_one_warning():
    """Host memory can run out after the up-front check (other processes pin too): the offloader keeps what it
    cannot pin on the device, as over its budget, and says so once."""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    expected = _chain_step(model, x)
    transport = FakeTransport(lag=1, refuse_pinning_after=2)
    off = offloader(transport, slab_bytes=1024)  # each step needs more than the two slabs that can be pinned
    with pytest.warns(UserWarning, match="could not pin") as record:
        for _ in range(2):
            assert_same_grads(_chain_step(model, x, off), expected)
    assert len(record) == 1, [str(w.message) for w in record]
    stats = off.stats()
    kept = dict(stats.kept)
    assert kept.get("pinning failed", 0) > 0 and stats.over_budget_bytes > 0, stats
    assert stats.offloaded_bytes > 0 and stats.host_reserved_bytes == 2 * 1024, stats


# -- configuration and the CPU-only no-op -------------------------------------------------------------------
def test_budget_above_free_ram_raises_before_allocating():
    transport = FakeTransport()
    with pytest.raises(MemtrainError, match="To resolve this error") as e:
        ActivationOffloader(transport, host_budget_bytes=2**62)
    assert "available" in str(e.value) and transport.slabs == 0


def test_a_machine_that_does_not_say_its_free_ram_is_not_refused(monkeypatch):
    monkeypatch.setattr(offload_mod, "available_host_bytes", lambda: None)
    transport = FakeTransport()
    off = ActivationOffloader(transport, host_budget_bytes=2**40)
    assert off.pool is not None and off.pool.capacity_bytes == 2**40 and transport.slabs == 0
    assert ActivationOffloader(transport).pool is not None and transport.slabs == 0  # the default budget too


def test_bad_arguments_are_reported_together():
    with pytest.raises(ConfigError) as e:
        ActivationOffloader(FakeTransport(), min_bytes=0, prefetch_depth=0, host_budget_bytes=-1)
    assert len(e.value.problems) == 3, e.value.problems


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_only_context_is_a_noop_that_says_so_once(monkeypatch):
    monkeypatch.setattr(offload_mod, "_NOOP_WARNED", False)
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="does nothing"):
        off = offload_activations(model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload_activations()  # no second warning
    assert not off.enabled
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), off:
        model(x).sum().backward()
    assert saved and all(type(t) in (torch.Tensor, nn.Parameter) for t in saved)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        offload_activations(device="cuda")


# -- apply_checkpointing(offload=True) and per-block policies ------------------------------------------------
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
    monkeypatch.setattr(offload_mod, "_NOOP_WARNED", False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    idx = torch.randint(0, 256, (2, 16))
    expected = gpt_step(model, idx)
    with pytest.warns(UserWarning, match="does nothing"):
        apply_checkpointing(model, offload=True)
    assert_same_grads(gpt_step(model, idx), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_a_cuda_transport_loads_as_none_without_cuda(monkeypatch):
    """A model saved with an offloader on a GPU loads on a CPU-only machine with a disabled (no-op) offloader."""
    import pickle

    monkeypatch.setattr(offload_mod, "_NOOP_WARNED", False)
    transport = object.__new__(CudaTransport)  # what a GPU run pickles: its device (the stream is not saved)
    transport.device = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="saved on cuda:0, which this machine does not have"):
        assert pickle.loads(pickle.dumps(transport)) is None


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
