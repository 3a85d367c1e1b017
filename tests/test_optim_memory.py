"""memtrain.optim.memory: the byte model equals what measure counts (exact, on the CPU), which parameters go to
the host, and the host step's measured rate."""

from __future__ import annotations

import pytest
import torch
from optim_training import HYPER, make_model, train
from torch import nn

from memtrain.measure import optimizer_state_bytes
from memtrain.models import GPT
from memtrain.optim import (
    build_optimizer,
    cpu_step_rate,
    offloaded_mask,
    optimizer_memory,
)

CONFIGS = [dict(state_precision=p, offload_fraction=f, step_in_backward=s)
           for p in ("fp32", "bf16", "int8") for f in (0.0, 0.3, 1.0) for s in (False, True) if not (f == 1.0 and s)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_byte_model_equals_what_measure_counts(config) -> None:
    model, opt, _ = train(config, steps=1)
    predicted = optimizer_memory([(p.numel(), p.dtype) for p in model.parameters()], device_type="cpu", **config)
    assert predicted.state_bytes == optimizer_state_bytes(opt), (
        f"predicted {predicted.state_bytes} bytes of state, measured {optimizer_state_bytes(opt)}")
    host = opt._host
    if host is None:
        assert predicted.host_bytes == 0 and predicted.offloaded_params == 0
        return
    buffers = {}
    for slot in host.slots:
        for t in (slot.master, *slot.grads, *(t for t in (slot.cast, slot.stage) if t is not None)):
            buffers[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    host_state = sum(v.untyped_storage().nbytes() for v in {id(v): v for e in host.state.values()
                                                            for v in e.values() if torch.is_tensor(v)}.values())
    assert predicted.host_state_bytes == host_state
    assert predicted.host_bytes == host_state + sum(buffers.values()), "host RAM: masters, gradients, casts, stages, state"
    assert predicted.offloaded_params == len(host.slots)


def test_int8_state_is_at_most_2_1_bytes_per_parameter() -> None:
    torch.manual_seed(0)
    gpt = GPT.from_preset("gpt-mini")  # 0.85M parameters; bias and norm vectors keep fp32 moments
    opt = build_optimizer(gpt.named_parameters(), lr=1e-3, state_precision="int8")
    x = torch.randint(0, 256, (1, 16))
    gpt(x, x).backward()
    opt.step()
    numel = sum(p.numel() for p in gpt.parameters())
    measured = optimizer_state_bytes(opt) / numel
    assert measured <= 2.1, f"{measured:.3f} bytes of int8 state per parameter (gpt-mini)"
    # A Llama-7B shape (hidden 4096, intermediate 11008, 32 layers, vocabulary 32000), from the byte model.
    h, i, v = 4096, 11008, 32000
    layer = [(h * h, torch.float32)] * 4 + [(h * i, torch.float32)] * 3 + [(h, torch.float32)] * 2
    llama = [(v * h, torch.float32)] + layer * 32 + [(h, torch.float32), (v * h, torch.float32)]
    per_param = optimizer_memory(llama, state_precision="int8").state_bytes / sum(n for n, _ in llama)
    assert per_param <= 2.1, f"{per_param:.4f} bytes per parameter for the 7B shape"
    assert optimizer_memory(llama, state_precision="bf16").state_bytes / sum(n for n, _ in llama) <= 4.001


def test_offloaded_parameters_are_the_last_ones() -> None:
    assert offloaded_mask([10, 10, 10, 10], 0.5) == [False, False, True, True]
    assert offloaded_mask([10, 10, 10, 10], 0.3) == [False, False, True, True]  # at least the fraction
    assert offloaded_mask([10, 10, 10, 10], 0.0) == [False] * 4
    assert offloaded_mask([10, 10, 10, 10], 1.0) == [True] * 4


def test_frozen_parameters_are_skipped() -> None:
    model = make_model()
    model[0].requires_grad_(False)  # e.g. LoRA's frozen base
    opt = build_optimizer(model.named_parameters(), **HYPER, offload_fraction=0.5)
    names = opt.param_groups[0]["param_names"]
    assert names == ["2.weight", "2.bias", "4.weight", "4.bias"], names


def test_cpu_step_rate_is_measured_for_each_precision() -> None:
    for precision in ("fp32", "bf16", "int8"):
        rate = cpu_step_rate(precision, n_params=1 << 14, repeats=1)
        assert rate > 0 and rate == rate, f"{precision}: {rate}"


def test_wrapper_subclass_state_counts_the_tensors_it_holds() -> None:
    """A state held as a tensor subclass wrapping others (torchao's 8-bit state, DTensor) counts its inner
    tensors, not its apparent dtype (TwoTensor stands in: a subclass holding two fp32 tensors)."""
    from torch.testing._internal.two_tensor import TwoTensor

    p = nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p]["wrapped"] = TwoTensor(torch.zeros(10), torch.zeros(10))
    assert optimizer_state_bytes(opt) == 80


def test_dtensor_state_counts_its_local_shard() -> None:
    """FSDP2 keeps optimizer state as DTensors, whose flattening also names their (non-tensor) device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        p = nn.Parameter(torch.zeros(10))
        opt = torch.optim.SGD([p], lr=0.1)
        opt.state[p]["exp_avg"] = distribute_tensor(torch.zeros(10), init_device_mesh("cpu", (1,)), [Shard(0)])
        assert optimizer_state_bytes(opt) == 40
    finally:
        dist.destroy_process_group()
