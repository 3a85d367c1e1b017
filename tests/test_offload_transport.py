"""Transport's synchronisation, checked on the CPU through the model of two CUDA streams (a missing wait
shows as NaN gradients or an error), and the CPU-only no-op that says so once."""

from __future__ import annotations

import warnings

import pytest
import torch
from offload_stream_model import (
    Chain,
    FakeTransport,
    assert_same_grads,
    chain_step,
    gpt_step,
    offloader,
)
from torch import nn

import memtrain.offload.transport as transport_mod
from memtrain.device import RealAccelerator
from memtrain.errors import ConfigError
from memtrain.models import GPT, GPTConfig
from memtrain.offload import ActivationOffloader, Transport, offload_activations


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


def test_sources_outlive_their_copies_to_the_host():
    """Copies lag far behind compute (8 transfers) and only one may be in flight: the offloader lets each source
    go only once its copy is done or the compute stream waits for it; no copy reads a freed source."""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    expected = chain_step(model, x)
    transport = FakeTransport(lag=8)
    for _ in range(2):
        assert_same_grads(chain_step(model, x, offloader(transport, prefetch_depth=1)), expected)
    assert transport.hazards == [], transport.hazards
    assert transport.tags("h2d"), "nothing came back from the host: the test would prove nothing"


class DeadBranch(Chain):
    """A chain with a branch kept alive but out of the loss: backward never unpacks its saved tensors, so their
    prefetched copies are freed unused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.dead = torch.tanh(self.layers[0](x) * 2)
        return super().forward(x)


@pytest.mark.parametrize("missing", ["release wait", "wait_stream", "drop wait"])
def test_the_stream_model_catches_a_missing_synchronisation(monkeypatch, missing):
    """The tests above can fail: without each synchronisation, gradients go wrong or the model of the caching
    allocator sees memory reused under the compute stream."""
    if missing == "release wait":  # _release_src dropping the source without the compute stream waiting
        monkeypatch.setattr(ActivationOffloader, "_release_src", lambda self, record: setattr(record, "src", None))
    elif missing == "wait_stream":
        monkeypatch.setattr(FakeTransport, "_wait_stream", lambda self, stream, other: None)
    else:  # a prefetched tensor freed unused, without the compute stream waiting for its copy
        monkeypatch.setattr(ActivationOffloader, "_drop_data", lambda self, record: setattr(record, "data", None))
    torch.manual_seed(0)
    model = DeadBranch()
    x = torch.randn(16, 8)
    expected = chain_step(model, x)
    transport = FakeTransport(lag=8)
    off = offloader(transport, prefetch_depth=1)
    try:
        for _ in range(2):  # the second step's allocations meet the first's freed blocks
            got = chain_step(model, x, off)
    except AssertionError as e:
        assert "before the compute stream waited" in str(e), e
        return
    assert any(not torch.equal(got[n], expected[n]) for n in expected), f"{missing}: gradients matched"
    assert transport.hazards, f"{missing}: no hazard seen"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_only_context_is_a_noop_that_says_so_once(monkeypatch):
    monkeypatch.setattr(transport_mod, "_NOOP_WARNED", False)
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_a_cuda_transport_loads_as_none_without_cuda(monkeypatch):
    """A model saved with an offloader on a GPU loads on a CPU-only machine with a disabled (no-op) offloader."""
    import pickle

    monkeypatch.setattr(transport_mod, "_NOOP_WARNED", False)
    transport = object.__new__(Transport)  # what a GPU run pickles: its device (the stream is not saved)
    transport.acc = RealAccelerator(torch.device("cuda", 0))
    transport.device = transport.acc.device
    with pytest.warns(UserWarning, match="saved on cuda:0, which this machine does not have"):
        assert pickle.loads(pickle.dumps(transport)) is None
