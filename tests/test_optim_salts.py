"""The salts of a ComposedOptimizer's bf16 rounding noise (bf16 moments, pure bf16): each parameter's is its place in
param_groups, the device part's first and the host part's after them, in a fresh optimizer as in a loaded one. A
salt shared by two parameters would give them the same rounding noise (correlated errors); a fresh optimizer that
numbered them otherwise than a loaded one would round differently after a resume from another precision."""

from __future__ import annotations

import pytest
import torch
from optim_training import HYPER, batches, make_model

from memtrain.optim import build_optimizer

# (build_optimizer's options, the model's dtype): bf16 moments (one device optimizer, or one a parameter stepping
# in backward), pure bf16 (bf16 weights, no master): each split between the device and the host.
CASES = {
    "bf16-moments": (dict(state_precision="bf16"), torch.float32),
    "bf16-moments-in-backward": (dict(state_precision="bf16", step_in_backward=True), torch.float32),
    "pure-bf16": (dict(state_precision="bf16", pure_bf16=True), torch.bfloat16),
}


def _model(dtype: torch.dtype) -> torch.nn.Module:
    return make_model().to(dtype)


def _step(model: torch.nn.Module, opt, data) -> None:
    for x, y in data:
        dtype = next(model.parameters()).dtype
        ((model(x.to(dtype)) - y.to(dtype)) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()


def _build(model: torch.nn.Module, options: dict, **extra):
    opt = build_optimizer(model.named_parameters(), **HYPER, **options, offload_fraction=0.5, **extra)
    assert opt._device_params and opt._host is not None and opt._host.slots, "the fixture must split the parameters"
    return opt


def _salts(opt) -> dict[str, int]:
    """Each parameter's salt, by name (device and host part)."""
    return {name: entry["salt"] for name, entry in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("case", CASES)
def test_a_fresh_optimizers_salts_are_its_parameters_places_distinct_across_parts(case) -> None:
    options, dtype = CASES[case]
    model = _model(dtype)
    opt = _build(model, options)
    try:
        _step(model, opt, batches(1))
        salts = _salts(opt)
        names = [n for n, _ in model.named_parameters()]
        assert sorted(salts) == sorted(names), f"state of {sorted(salts)}, parameters {names}"
        assert [salts[n] for n in names] == list(range(len(names))), (
            f"salts by place {[salts[n] for n in names]}; device part {len(opt._device_params)} parameters, host "
            f"part {len(opt._host.slots)}: each its own, by its place")
    finally:
        opt.close()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("saved_as", ["same", "fp32"])
def test_a_loaded_optimizer_salts_as_a_fresh_one(case, saved_as) -> None:
    """A state saved in the same precision (its salts kept) or in fp32 (converted: salts numbered on load) gives
    each parameter the salt a fresh optimizer gives it."""
    options, dtype = CASES[case]
    fresh_model = _model(dtype)
    fresh = _build(fresh_model, options)
    source_model = _model(dtype if saved_as == "same" else torch.float32)  # torch's AdamW steps fp32 weights
    source_options = options if saved_as == "same" else {}
    source = build_optimizer(source_model.named_parameters(), **HYPER, **source_options,
                             offload_fraction=0.5 if saved_as == "same" else 0.0)
    loaded = _build(_model(dtype), options)
    try:
        _step(fresh_model, fresh, batches(1))
        _step(source_model, source, batches(1))
        loaded.load_state_dict(source.state_dict())
        assert _salts(loaded) == _salts(fresh), f"loaded {_salts(loaded)}, fresh {_salts(fresh)}"
    finally:
        for opt in (fresh, source, loaded):
            opt.close()


@pytest.mark.parametrize("case", CASES)
def test_a_resume_is_bit_identical(case) -> None:
    """2 steps, state_dict, a new model and optimizer loading both, 2 more steps: the same weights as 4 steps in a
    row (max abs diff 0.0)."""
    options, dtype = CASES[case]
    data = batches(4)
    straight_model = _model(dtype)
    straight = _build(straight_model, options)
    first_model = _model(dtype)
    first = _build(first_model, options)
    resumed_model = _model(dtype)
    resumed = None
    try:
        _step(straight_model, straight, data)
        _step(first_model, first, data[:2])
        saved = first.state_dict()
        resumed_model.load_state_dict(first_model.state_dict())
        resumed = _build(resumed_model, options)
        resumed.load_state_dict(saved)
        _step(resumed_model, resumed, data[2:])
        diff = max((p.float() - q.float()).abs().max().item()
                   for p, q in zip(straight_model.parameters(), resumed_model.parameters(), strict=True))
        assert diff == 0.0, f"resumed differs from straight by max abs diff {diff:.3e}"
    finally:
        for opt in (straight, first, resumed):
            if opt is not None:
                opt.close()
