"""MixedPrecision and resolve_precision: the right autocast and scaler per mode, choices with reasons, no silent
switches. CUDA choices are tested by faking the device's capability (CI has no GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from memtrain.errors import ConfigError
from memtrain.measure import cpu_allocation_peak_bytes
from memtrain.models import GPT, GPTConfig
from memtrain.precision import MixedPrecision, resolve_precision


def test_fp32_is_a_plain_context_and_has_no_scaler():
    mp = MixedPrecision("fp32", "cpu")
    assert isinstance(mp.autocast(), contextlib.nullcontext)
    assert mp.scaler is None and mp.dtype == torch.float32
    with mp.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.parametrize(("mode", "dtype"), [("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16)])
def test_mixed_modes_autocast_matmuls_to_16_bit(mode, dtype):
    mp = MixedPrecision(mode, "cpu")
    with mp.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
    assert mp.dtype == dtype


def _forward_peak_bytes(autocast: contextlib.AbstractContextManager) -> int:
    """The CPU allocator's high-water mark during a forward of 4 checkpointed 512 x 512 fp32 layers (1 MiB of
    weights each) on a batch of 2, above what was allocated before it."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512, bias=False) for _ in range(4)]
    x = torch.randn(2, 512, requires_grad=True)

    def forward() -> None:
        with autocast:
            h = x
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False)

    return cpu_allocation_peak_bytes(forward)


def test_autocast_keeps_no_16_bit_copy_of_the_weights_through_a_checkpointed_forward():
    """torch.autocast's weight-cast cache would hold each fp32 weight's bf16 copy until forward ends, which is
    what checkpointing (and FSDP2's resharding) frees the blocks' memory for: memtrain's autocast has none."""
    mib = 2**20
    cached = _forward_peak_bytes(torch.autocast("cpu", dtype=torch.bfloat16))  # torch's default: the cache on
    ours = _forward_peak_bytes(MixedPrecision("bf16-mixed", "cpu").autocast())
    assert cached >= 4 * 0.5 * mib, f"{cached / mib:.2f} MiB: the default cache keeps 4 bf16 weights of 0.5 MiB"
    assert ours < 2 * 0.5 * mib, f"{ours / mib:.2f} MiB: two cast weights at a time or more"


def test_only_fp16_gets_a_scaler_and_each_instance_its_own():
    a, b = MixedPrecision("fp16-mixed", "cpu"), MixedPrecision("fp16-mixed", "cpu")
    assert isinstance(a.scaler, torch.amp.GradScaler) and a.scaler.is_enabled()
    assert a.scaler is not b.scaler  # the scale is per-run state
    assert MixedPrecision("bf16-mixed", "cpu").scaler is None
    assert a == b  # the scaler is not part of the configuration's identity


def test_bf16_gradients_stay_close_to_fp32():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16))
    x = torch.randint(0, 256, (2, 16))
    y = torch.roll(x, -1, dims=1)
    model(x, y).backward()
    fp32 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with MixedPrecision("bf16-mixed", "cpu").autocast():
        loss = model(x, y)
    assert loss.dtype == torch.float32  # the model computes its loss on fp32 logits
    loss.backward()
    rel = max(((p.grad - g).norm() / g.norm()).item() for p, g in zip(model.parameters(), fp32, strict=True))
    assert rel < 0.1, f"bf16 vs fp32 gradients: worst relative error {rel:.3f}"


@pytest.mark.parametrize("mode", ["fp64", "bf16", "float16", "", None])
def test_unknown_mode_raises_instead_of_falling_back(mode):
    with pytest.raises(ConfigError, match="is not one of fp32, bf16-mixed, fp16-mixed"):
        MixedPrecision(mode, "cpu")


def test_bad_device_type_raises():
    with pytest.raises(ConfigError, match="no index"):
        MixedPrecision("bf16-mixed", "cuda:0")
    with pytest.raises(ConfigError, match="no autocast for device type 'meta'"):
        MixedPrecision("bf16-mixed", "meta")


def test_cpu_resolves_to_fp32_with_a_reason():
    choice, reason = resolve_precision("cpu")
    assert choice == "fp32"
    assert reason.startswith("fp32, because: CPU") and "--precision bf16-mixed" in reason


def test_explicit_request_is_returned_unchanged_and_checked():
    assert resolve_precision("cpu", "fp16-mixed")[0] == "fp16-mixed"
    choice, reason = resolve_precision(torch.device("cpu"), "bf16-mixed")
    assert choice == "bf16-mixed" and reason.startswith("bf16-mixed, because: requested") and "Hint:" in reason
    assert resolve_precision("cpu", "fp32") == ("fp32", "fp32, because: requested")
    with pytest.raises(ConfigError, match="'bf16' is not one of"):
        resolve_precision("cpu", "bf16")
    with pytest.raises(ConfigError, match="not a torch device"):
        resolve_precision("gpu0")


def _fake_cuda(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_cuda_with_native_bf16_resolves_to_bf16(monkeypatch):
    _fake_cuda(monkeypatch, (9, 0))
    assert resolve_precision("cuda") == ("bf16-mixed", "bf16-mixed, because: CUDA SM 9.0 supports bf16")


def test_older_cuda_resolves_to_fp16_and_warns_on_requested_bf16(monkeypatch):
    _fake_cuda(monkeypatch, (7, 5))
    choice, reason = resolve_precision("cuda:0")
    assert choice == "fp16-mixed" and reason.startswith("fp16-mixed, because: CUDA SM 7.5 has no native bf16")
    choice, reason = resolve_precision("cuda", "bf16-mixed")
    assert choice == "bf16-mixed" and "Hint: CUDA SM 7.5 has no native bf16" in reason  # never switched


def test_cuda_without_a_device_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        resolve_precision("cuda")


def test_other_devices_resolve_to_fp32_with_a_reason():
    choice, reason = resolve_precision("meta")
    assert choice == "fp32" and "no verified 16-bit default for device type 'meta'" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only case")
def test_cuda_modes_without_cuda_raise_instead_of_running_disabled():
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        MixedPrecision("fp16-mixed", "cuda")
    assert MixedPrecision("fp32", "cuda").scaler is None  # fp32 needs nothing from the device


def test_errors_name_the_argument_not_a_command_line_flag():
    """The library cannot know which flag (if any) set a value: it names its own argument; the CLI translates."""
    with pytest.raises(ConfigError) as info:
        MixedPrecision("fp8", "cpu")
    assert "precision='fp8' is not one of" in str(info.value) and "--" not in str(info.value), info.value
    with pytest.raises(ConfigError) as info:
        MixedPrecision("bf16-mixed", "meta")
    assert "pass precision='fp32'" in str(info.value) and "--" not in str(info.value), info.value
