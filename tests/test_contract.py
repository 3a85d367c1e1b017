"""The GPU-speed contract (docs/design.md, issue 18), asserted on the CPU for every set-up the planner can choose.

The counts come from ``benchmarks/bench_contract.py`` (which prints them: ``python benchmarks/bench_contract.py``):

- graph breaks under ``torch.compile`` caused by memtrain: 0, and at least one graph (nothing runs eager
  silently), unless ``apply_plan`` refuses the pairing with a ``ConfigError``;
- host syncs per optimizer step on the accumulator's path: at most 1 with clipping or the fp16 scaler, 0 without;
- aten ops that may launch a kernel, per parameter tensor per optimizer step: within 2x ``torch.optim.AdamW(fused=True)``'s, per moment
  precision;
- bytes over the host link per optimizer step, per offload mode: equal to the planner's prediction.

Each section is measured once per module (about a minute on 2 CPU cores in all); the counters themselves are
checked first, on calls whose counts are known.
"""

from __future__ import annotations

import collections
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from memtrain.measure import KernelOps

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_contract.py"


def _load():
    if "bench_contract" in sys.modules:
        return sys.modules["bench_contract"]
    spec = importlib.util.spec_from_file_location("bench_contract", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is being executed
    spec.loader.exec_module(module)
    return module


bench = _load()


def _measured(section):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload's no-op note, torch.compile's notes: not what is asserted
        return {(c.setup if hasattr(c, "setup") else c.optimizer, getattr(c, "clip", None)): c for c in section()}


@pytest.fixture(scope="module")
def compile_counts():
    return _measured(bench.graph_breaks)


@pytest.fixture(scope="module")
def sync_counts():
    return _measured(bench.host_syncs)


@pytest.fixture(scope="module")
def op_counts():
    return _measured(bench.optimizer_ops)


@pytest.fixture(scope="module")
def link_counts():
    return _measured(bench.link_bytes)


# -- the counters count what they say ----------------------------------------------------------------------------
def test_count_syncs_counts_each_kind_of_host_sync_and_restores_torch():
    t = torch.ones(3)
    with bench.count_syncs() as calls:
        t.sum().item()
        t.tolist()
        t.cpu()
        bool(t[0])
        float(t[0])
        int(t[0])
        torch.nonzero(t)
        t.nonzero()
        t.add(1)  # not a sync
    kinds = collections.Counter()
    for (call, where), n in calls.items():
        assert where.startswith("tests/test_contract.py:"), where
        kinds[call] += n
    assert kinds == {"item": 1, "tolist": 1, "cpu": 1, "bool": 1, "float": 1, "int": 1, "nonzero": 2}, kinds
    with bench.count_syncs() as after:
        pass
    t.sum().item()
    assert not after, "count_syncs must put torch's methods back"
    assert torch.Tensor.item.__name__ == "item" and not hasattr(torch.Tensor.item, "__wrapped__")


def test_op_counter_counts_kernel_ops_and_views_apart():
    a, b = torch.ones(4), torch.ones(4)
    with KernelOps() as counter:
        a.add_(b).mul_(2)
        torch._foreach_add_([a, b], 1)
        a.view(2, 2).detach()
        torch.empty(3)
    assert counter.kernels == {"aten.add_.Tensor": 1, "aten.mul_.Tensor": 1, "aten._foreach_add_.Scalar": 1}, \
        counter.kernels
    assert (counter.views, counter.others) == (2, 1), (counter.views, counter.others)


def test_counting_transport_counts_the_bytes_of_both_directions():
    from memtrain.offload import ActivationOffloader

    transport = bench.CountingTransport()
    offloader = ActivationOffloader(transport, min_bytes=1, host_budget_bytes=2**24)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)
    with offloader:
        # Saves h (8 KiB) for w's gradient and y (8 KiB) for relu's; w and x are leaves: they stay.
        h = x * 2
        y = (h @ w).relu()
    y.sum().backward()
    assert transport.to_host_bytes == transport.to_device_bytes == 2 * 32 * 64 * 4, (
        transport.to_host_bytes, transport.to_device_bytes)


# -- the contract --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", list(bench.GRAPH_BREAK_SETUPS))
def test_compiled_setup_has_no_graph_break_caused_by_memtrain(compile_counts, setup):
    c = compile_counts[(setup, None)]
    assert c.error is None, f"{setup}: {c.error}"
    if c.refused is not None:
        return  # apply_plan refused compile with this technique, with one clear error: nothing runs eager
    assert c.graphs >= 1 and c.memtrain_breaks == 0, (
        f"{setup}: {c.graphs} graph(s), {c.memtrain_breaks} break(s) caused by memtrain of {c.breaks}: "
        f"{c.reasons}")


@pytest.mark.parametrize("setup, clip", bench.sync_cases(),
                         ids=[f"{s}-{'clip' if clip else 'noclip'}" for s, clip in bench.sync_cases()])
def test_host_syncs_per_optimizer_step(sync_counts, setup, clip):
    c = sync_counts[(setup, clip)]
    if c.error is not None and "bitsandbytes" in c.error:
        pytest.skip(c.error)
    assert c.error is None, f"{setup}: {c.error}"
    bound = bench.sync_bound(setup, clip)
    assert c.syncs <= bound, f"{setup}, clipping {'on' if clip else 'off'}: {c.syncs} host syncs per optimizer " \
                             f"step, at most {bound} allowed: {c.sites}"


@pytest.mark.parametrize("optimizer", bench.OPS_OPTIMIZERS[1:])
def test_optimizer_ops_per_parameter_tensor_within_the_bound_over_fused_adamw(op_counts, optimizer):
    fused = op_counts[("torch fused AdamW", None)]
    c = op_counts[(optimizer, None)]
    if c.error is not None and "bitsandbytes" in c.error:
        pytest.skip(c.error)
    assert c.error is None and fused.error is None, (c.error, fused.error)
    assert c.ops_per_tensor <= bench.ops_bound(optimizer, fused.ops_per_tensor), (
        f"{optimizer}: {c.ops_per_tensor:.2f} aten ops per parameter tensor ({c.ops} over {c.tensors} tensors; "
        f"most frequent {c.top}), fused AdamW {fused.ops_per_tensor:.2f} ({fused.ops})")


@pytest.mark.parametrize("setup", list(bench.LINK_SETUPS))
def test_host_link_bytes_equal_the_planners_prediction(link_counts, setup):
    c = link_counts[(setup, None)]
    assert c.error is None, f"{setup}: {c.error}"
    assert c.to_host_bytes > 0 and c.to_device_bytes > 0, c
    assert (c.to_host_bytes, c.to_device_bytes) == (c.predicted_to_host, c.predicted_to_device), (
        f"{setup}: {c.to_host_bytes} bytes crossed to the host and {c.to_device_bytes} back in one optimizer step, "
        f"the plan's HostLink says {c.predicted_to_host} and {c.predicted_to_device} "
        f"({c.measured_bytes - c.predicted_bytes:+d} in all)")
