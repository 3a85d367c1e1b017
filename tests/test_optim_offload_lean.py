"""CPUOffloadOptimizer with lean host moments (state_precision "bf16" or "int8"): the fp32 master stays on the host,
the moments shrink. It trains as the device optimizer of the same precision, resumes bit for bit, holds 1/2 (bf16)
or about 1/4 (int8) of fp32's moment bytes, and ``memtrain train --offload-optimizer --optimizer-state int8`` runs.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from optim_training import HYPER, batches, make_model, max_diff
from safetensors import safe_open
from torch import nn

from memtrain.accumulation import GradientAccumulator
from memtrain.cli import main
from memtrain.errors import ConfigError
from memtrain.optim import CPUOffloadOptimizer, build_optimizer, optimizer_memory

pytest.importorskip("bitsandbytes")

# The offloaded optimizer runs the device one's own kernels (BF16StateAdamW, bitsandbytes' 8-bit AdamW) on host
# tensors, its bf16 rounding noise salted per parameter as the device optimizer's. What differs is float rounding of
# the gradient: the host step applies the normalisation and the clip coefficient as one multiply (1 ulp, as fp32
# offload's tolerance of 1e-6 allows). With int8 moments that stays an ulp of the weights; with bf16 moments an
# fp32 moment one ulp away now and then rounds to the other bf16 neighbour (a 2**-8 relative step of a moment,
# about lr * 2**-9 = 2e-5 of an update): measured 4.9e-5 after 6 steps at lr 1e-2, so 1e-4 (1% of lr).
PARITY_TOL = {"bf16": 1e-4, "int8": 1e-6}


def _offloaded(model: nn.Module, precision: str) -> CPUOffloadOptimizer:
    return CPUOffloadOptimizer(model.named_parameters(), state_precision=precision, **HYPER)


def _train(model: nn.Module, opt: torch.optim.Optimizer, data: list, *, micro: int = 3, max_norm: float = 1.0):
    """Trains through GradientAccumulator (sum-reduced, variable lengths, clipped): the loop train() runs."""
    acc = GradientAccumulator(model, opt, steps=micro, max_grad_norm=max_norm)
    for step in range(len(data) // micro):
        for m in range(micro):
            x, y = data[step * micro + m]
            with acc.micro_batch(is_last=m == micro - 1):
                acc.backward(((model(x) - y) ** 2).sum(), reduction="sum", items=x.shape[0])
        acc.step()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_offloaded_lean_moments_train_as_the_device_optimizer_of_the_same_precision(precision) -> None:
    data = batches(18)
    device, offloaded = make_model(), make_model()
    device_opt = build_optimizer(device.named_parameters(), **HYPER, state_precision=precision)
    host_opt = _offloaded(offloaded, precision)
    _train(device, device_opt, data)
    _train(offloaded, host_opt, data)
    diff = max_diff(device, offloaded)
    assert diff <= PARITY_TOL[precision], f"{precision}: max |w_device - w_offloaded| = {diff:.3e} after 6 steps"
    moved = max_diff(device, make_model())
    assert moved > 100 * max(diff, 1e-6), f"the weights moved only {moved:.3e}: the test would not see a difference"
    entry = host_opt.state[offloaded[2].weight]  # 8,192 elements: int8 quantises it
    if precision == "bf16":
        assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.bfloat16, entry
    else:
        assert entry["state1"].dtype == entry["state2"].dtype == torch.uint8, entry
    assert all(t.device.type == "cpu" for t in entry.values() if torch.is_tensor(t))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_state_dict_round_trip_resumes_bit_identically(precision) -> None:
    data = batches(18)
    straight = make_model()
    opt = _offloaded(straight, precision)
    _train(straight, opt, data[:9])
    saved_weights, saved_state = copy.deepcopy(straight.state_dict()), copy.deepcopy(opt.state_dict())
    _train(straight, opt, data[9:])

    resumed = make_model(seed=5)
    resumed.load_state_dict(saved_weights)
    opt2 = _offloaded(resumed, precision)
    opt2.load_state_dict(saved_state)
    entry = opt2.state[resumed[2].weight]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[precision]
    assert entry["exp_avg" if "exp_avg" in entry else "state1"].dtype == dtype, "the loaded moments changed precision"
    _train(resumed, opt2, data[9:])
    assert max_diff(straight, resumed) == 0.0, f"{precision}: the resumed run differs by {max_diff(straight, resumed)}"


@pytest.mark.parametrize("source, target", [("fp32", "int8"), ("int8", "bf16"), ("bf16", "fp32")])
def test_a_state_of_another_precision_loads_converted(source, target) -> None:
    model = make_model()
    opt = _offloaded(model, source)
    _train(model, opt, batches(6))
    saved = opt.state_dict()
    opt.close()
    other = _offloaded(model, target)
    other.load_state_dict(saved)
    entry = other.state[model[2].weight]
    m = entry["exp_avg"] if "exp_avg" in entry else entry["state1"]
    assert m.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[target]
    _train(model, other, batches(6, seed=2))  # and it steps


def _host_bytes(opt: CPUOffloadOptimizer) -> tuple[int, int]:
    """(moment bytes, all host bytes: masters, gradient buffers, state), each storage once, counted on the
    tensors themselves."""
    buffers = {}
    for slot in opt.slots:
        for t in (slot.master, *slot.grads, *(t for t in (slot.cast, slot.stage) if t is not None)):
            buffers[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    state = {id(v): v for e in opt.state.values() for v in e.values() if torch.is_tensor(v)}.values()
    moments = sum(v.untyped_storage().nbytes() for v in state if v.ndim > 0 and v.numel() > 256)  # no step/qmap
    return moments, sum(v.untyped_storage().nbytes() for v in state) + sum(buffers.values())


def test_host_moments_take_half_bf16_and_a_quarter_int8_of_fp32s_bytes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # 1.05M parameters, every weight quantised
    numel = sum(p.numel() for p in model.parameters())
    measured = {}
    for precision in ("fp32", "bf16", "int8"):
        opt = _offloaded(model, precision)
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
        measured[precision] = _host_bytes(opt)
        predicted = optimizer_memory([(p.numel(), p.dtype) for p in model.parameters()], state_precision=precision,
                                     offload_fraction=1.0, device_type="cpu")
        assert predicted.host_bytes == measured[precision][1], (precision, predicted, measured[precision])
        opt.close()
    m32 = measured["fp32"][0]
    assert measured["bf16"][0] / m32 == 0.5, measured
    assert 0.25 < measured["int8"][0] / m32 <= 0.255, measured  # the codes plus one fp32 scale per 256
    per_param = {k: round(v[1] / numel, 2) for k, v in measured.items()}
    # fp32 master 4 + gradient buffer 4 + moments 8 / 4 / 2.03 (fp32 biases under 4,096 elements add a little).
    assert per_param["fp32"] <= 16.01 and per_param["bf16"] <= 12.01 and per_param["int8"] <= 10.1, per_param


def test_lean_moments_are_adamws() -> None:
    with pytest.raises(ConfigError, match="lean moments and pure bf16 are memtrain's AdamW's") as info:
        CPUOffloadOptimizer(make_model().named_parameters(), torch.optim.SGD, state_precision="int8", lr=0.1)
    assert "To resolve this error" in str(info.value)
    with pytest.raises(ConfigError, match="state_precision='fp16' is not one of"):
        CPUOffloadOptimizer(make_model().named_parameters(), state_precision="fp16", lr=0.1)


def test_cli_trains_with_the_optimizer_offloaded_and_int8_moments(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--model", "gpt-tiny", "--max-steps", "3", "--micro-batch-size", "4", "--no-progress",
                 "--offload-optimizer", "--optimizer-state", "int8", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    chosen = result["plan"]["settings"]["choices"]["optimizer"]
    assert (chosen["placement"], chosen["state_precision"], result["steps"]) == ("offload", "int8", 3), result
    with safe_open(out / "checkpoints" / "step-0000003" / "tensors.safetensors", "pt") as f:
        codes = {f.get_tensor(k).dtype for k in f.keys() if k.startswith("/optimizer/state/") and "state1" in k}
    assert torch.uint8 in codes, codes  # the embedding's 8,192 elements: 8-bit moments saved as they are
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["resumed_from"], result["steps"]) == (3, 4), result


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_estimate_counts_the_host_bytes_the_offloaded_optimizer_holds(precision) -> None:
    from memtrain.choices import Choices, OptimizerChoice
    from memtrain.estimate import estimate
    from memtrain.models import GPT, GPT_PRESETS

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["gpt-tiny"])
    setup = Choices(optimizer=OptimizerChoice(placement="offload", state_precision=precision))
    predicted = estimate(model, (2, 64), device="cpu", setup=setup).host_bytes
    opt = _offloaded(model, precision)
    x = torch.randint(0, 256, (2, 64))
    model(x, x).backward()
    opt.step()
    measured = _host_bytes(opt)[1]
    opt.close()
    assert predicted == measured, f"{precision}: estimate says {predicted} host bytes, the optimizer holds {measured}"


def test_int8_cpu_steps_large_tensors_in_block_aligned_pieces_bit_identically(monkeypatch) -> None:
    """Without the fused host kernels (memtrain.optim.host_kernels), bitsandbytes' CPU update dequantises whatever it
    is given to fp32: a large tensor steps a piece of at most INT8_CPU_CHUNK elements at a time (bounded transient
    host RAM), with the whole tensor's results bit for bit."""
    import bitsandbytes

    import memtrain.optim.moments as moments
    from memtrain.optim import host_kernels

    monkeypatch.setattr(host_kernels, "_off", True)

    calls: list[int] = []
    real = bitsandbytes.functional.optimizer_update_8bit_blockwise

    def spy(name, g, *args, **kwargs):
        calls.append(g.numel())
        return real(name, g, *args, **kwargs)

    monkeypatch.setattr(bitsandbytes.functional, "optimizer_update_8bit_blockwise", spy)
    results = {}
    for chunk in (1 << 22, 512):  # whole tensors, then pieces of two blocks (a tail of 5,000 % 512 = 392)
        monkeypatch.setattr(moments, "INT8_CPU_CHUNK", chunk)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(100, 50), nn.Linear(50, 128))  # weights of 5,000 and 6,400 elements
        opt = _offloaded(model, "int8")
        calls.clear()
        for x in torch.randn(3, 4, 100):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        results[chunk] = ([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))
        assert max(calls) <= chunk, (chunk, calls)
        opt.close()
    assert len(calls) == 3 * (10 + 13), calls  # -(-5000 // 512) + -(-6400 // 512) pieces a step
    (whole, whole_sd), (pieces, pieces_sd) = results[1 << 22], results[512]
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces, strict=True)), "the pieces stepped differently"
    for name, entry in whole_sd["state"].items():
        for k, v in entry.items():
            assert not torch.is_tensor(v) or torch.equal(v, pieces_sd["state"][name][k]), (name, k)
