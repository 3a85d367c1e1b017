"""Pure bf16 training's optimizer: AdamW on bf16 weights with no fp32 master, the update rounded stochastically.

Trade-off: an fp32 master costs 4 bytes per parameter (plus 2 for a bf16 device copy when the master is on the
host); without it, an update smaller than half a bf16 ulp of its weight (2**-9 of it) would be lost every step
when rounded to nearest, and training stalls once the learning rate has decayed. Rounding stochastically (up with
probability equal to the fraction of the gap, as torchao's ``bf16_stochastic_round``) keeps the expected weight
equal to the fp32 result, so small updates accumulate on average. The update itself is computed in fp32.

- ``stochastic_round_to_bf16``: the rounding on its own (fresh random noise), for tests and for users.
- ``PureBF16AdamW``: the optimizer, on CPU or CUDA tensors; moments in fp32 (8 bytes per parameter) or bf16 (4,
  rounded stochastically as well). Its passes reuse ``BF16StateAdamW``'s counter-based noise table, so a resumed
  run rounds as the straight one.

NOTE: bitsandbytes' 8-bit AdamW on bf16 parameters rounds the new weight to nearest (its CPU path
``p.data.copy_(p_fp32)``, its CUDA kernel a plain cast): int8 moments are refused with pure bf16 rather than
silently losing small updates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from memtrain.errors import ConfigError, MemtrainError
from memtrain.message import arg
from memtrain.optim import host_kernels
from memtrain.optim.moments import (
    NOISE_OFFSETS,
    check_sliceable,
    init_rounding_state,
    noise_key,
    noise_table,
    padded_numel,
    restore_rounding_state,
    split_passes,
    with_gradients_by_device,
)
from memtrain.techniques import SetUp, Terms
from memtrain.techniques.pure_bf16 import PURE_BF16_INT8

PURE_BF16_MOMENTS = ("fp32", "bf16")
PURE_STATE_BYTES = {"fp32": 8, "bf16": 4}  # the moments' bytes a parameter
# Elements per pass: the scratch holds 8 (fp32 moments) or 16 (bf16 moments) bytes an element of them, so a pass is
# a quarter of BF16StateAdamW's on CUDA (64 MiB of scratch at most; an 8B model's step is then about 2,000 passes).
PURE_BF16_CHUNK = {"cuda": 1 << 22, "cpu": 1 << 18}


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (fp32) rounded to one of its two neighbouring bf16 values, up with probability equal to the fraction
    of the gap below it: unbiased, ``E[round(x)] == x``. Values exact in bf16 (and inf/NaN) are returned as they are.

    Example:
        >>> x = torch.full((100_000,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bf16 (1 + 2**-7)
        >>> abs(stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float().mean().item() - x[0].item()) < 1e-4
        True
    """
    if x.dtype != torch.float32:
        raise MemtrainError(f"stochastic_round_to_bf16 rounds fp32 tensors, got {x.dtype}. To resolve this error, "
                            "pass x.float().")
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = x.contiguous().view(torch.int32) + noise
    return round_bits_(bits, x).view(torch.float32).to(torch.bfloat16)


def round_bits_(bits: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Drops the low 16 bits of ``bits`` (the fp32 pattern plus noise in [0, 2**16)); inf and NaN keep theirs."""
    bits.bitwise_and_(-65536)
    return torch.where(original.isfinite(), bits, original.contiguous().view(torch.int32))


class PureBF16AdamW(torch.optim.Optimizer):
    """AdamW over bf16 parameters with no fp32 master: the update in fp32, the weights (and bf16 moments) rounded
    back stochastically.

    Trade-off: 2 bytes per parameter of weights and 2 of gradient instead of 4 + 4 (fp32 weights) or 4 + 2 + 2
    (fp32 master beside bf16 weights), for weights that move by unbiased random steps of at most one bf16 ulp on
    top of the update (about 2**-8 relative): training loss follows an fp32-master run closely over short runs
    (tests/test_pure_bf16.py states the tolerance), but it is a change of numerics, so it is an explicit choice.

    On host tensors each tensor steps in one fused C++ pass (``memtrain.optim.host_kernels``: 14 bytes a parameter
    with bf16 moments, no scratch, the same noise keys). On a device, one pass takes up to ``PURE_BF16_CHUNK``
    elements of all the parameters of a group: fp32 copies of the
    weights, gradients (and bf16 moments) in one scratch buffer (16 bytes an element, bounded by the chunk), torch's
    fused AdamW kernel on them, the noise added to the bit patterns, the low bits dropped, the results copied back.

    Args:
        params: bf16 parameters or groups (fp32 ones are refused at ``step()``: they need no stochastic rounding).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        state_precision: "fp32" (8 bytes per parameter of moments) or "bf16" (4, stochastic rounding).
        seed: seeds the rounding noise, drawn per (parameter, step), so a resumed run rounds as the straight one.

    Raises:
        ConfigError: an unknown ``state_precision`` (int8 names why it is refused).
        MemtrainError: at ``step()``, a parameter that is not bf16, a non-contiguous one, or a device without torch's
            fused AdamW kernel.

    Example:
        >>> model = torch.nn.Linear(8, 4).bfloat16()
        >>> opt = PureBF16AdamW(model.parameters(), lr=1e-3)
        >>> model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step(); model.weight.dtype, opt.state[model.weight]["exp_avg"].dtype
        (torch.bfloat16, torch.bfloat16)
    """

    _step_supports_amp_scaling = True  # takes found_inf (GradientAccumulator's skip flag) as fused AdamW does

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state_precision: str = "bf16", seed: int = 0):
        check_pure_bf16_moments(state_precision)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_precision = state_precision
        self.seed = int(seed)
        self._salts = 0
        self.salts: dict[int, int] = {}  # id(parameter) -> its rounding salt, where an owner fixes it

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then the moments back to this optimizer's precision (torch casts them to the parameter's)."""
        super().load_state_dict(state_dict)
        restore_rounding_state(self, torch.bfloat16 if self.state_precision == "bf16" else torch.float32)

    def entry_for(self, p: torch.Tensor, moments: tuple[float, torch.Tensor, torch.Tensor],
                  salt: int) -> dict[str, Any]:
        """A state entry for ``p`` holding ``moments`` (step, fp32 moments) in this optimizer's precision, with
        fresh rounding counters: ``ComposedOptimizer.load_state_dict`` converting a state saved in another precision."""
        step, m, v = moments
        dtype = torch.bfloat16 if self.state_precision == "bf16" else torch.float32
        return {"step": torch.tensor(step, dtype=torch.float32, device=p.device),
                "exp_avg": m.to(p.device, dtype).view(p.shape).clone(),
                "exp_avg_sq": v.to(p.device, dtype).view(p.shape).clone(), "draws": 0, "salt": salt}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if getattr(self, "grad_scale", None) is not None:
            raise MemtrainError("PureBF16AdamW got an fp16 GradScaler's scale: pure bf16 trains under bf16-mixed "
                                f"(no scaler). To resolve this error, pass {arg('precision', 'bf16-mixed')}.")
        for group in self.param_groups:
            for device, params in with_gradients_by_device(group, self._check).items():
                self._step_device(group, params, device, found_inf)
        return loss

    def _check(self, p: torch.Tensor) -> None:
        if p.dtype != torch.bfloat16:
            raise MemtrainError(
                f"PureBF16AdamW steps bf16 parameters (there is no master copy), got a {p.dtype} parameter. To "
                "resolve this error, cast the model to bf16 first (model.to(torch.bfloat16)), or use "
                "torch.optim.AdamW on fp32 weights.")
        check_sliceable(p, "PureBF16AdamW")
        init_rounding_state(self, p, torch.bfloat16 if self.state_precision == "bf16" else torch.float32)

    def _step_device(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     found_inf: torch.Tensor | None) -> None:
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        if found_inf is not None:
            found_inf = found_inf.to(device, non_blocking=True)
        if all(host_kernels.runs_fused(p) for p in params):
            self._step_fused(group, params, found_inf)
        else:
            self._step_passes(group, params, device, found_inf)
        for state in states:
            state["draws"] += 1
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))  # a skipped step does not count (as torch's)

    def _step_fused(self, group: dict[str, Any], params: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
        """Host tensors: one fused pass a tensor (memtrain.optim.host_kernels), the weight and bf16 moments rounded
        with the noise of the keys the multi-tensor path gives a tensor's first segment."""
        step = host_kernels.kernels().adamw_lean_
        found_inf = host_kernels.as_flag(found_inf)
        for p in params:
            state = self.state[p]
            base = (self.seed, state["salt"], state["draws"], 0)
            keys = [noise_key(*base, 2 + k) % NOISE_OFFSETS for k in range(3)]
            step(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], state["step"],
                 *host_kernels.hyperparameters(group), None, found_inf, *keys)

    def _step_passes(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     found_inf: torch.Tensor | None) -> None:
        """Device tensors (or no built kernel): passes of multi-tensor ops over up to ``PURE_BF16_CHUNK`` elements."""
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        lean = self.state_precision == "bf16"
        width = 4 if lean else 2  # fp32 copies per element in the scratch: weight, gradient (and both moments)
        chunk = PURE_BF16_CHUNK.get(device.type, 1 << 20)
        grads = [p.grad.contiguous().view(-1) for p in params]
        scratch = torch.empty(width * min(sum(padded_numel(p.numel()) for p in params), chunk), dtype=torch.float32,
                              device=device)
        for segments in split_passes([p.numel() for p in params], chunk):
            slots = [padded_numel(end - start) for _, start, end in segments]
            n = sum(slots)
            views: list[list[torch.Tensor]] = [[] for _ in range(width)]  # fp32: p, g (, m, v)
            sources: list[list[torch.Tensor]] = [[] for _ in range(4)]  # the stored p, g, m, v
            keys: list[list[int]] = [[], [], []]  # noise offsets of p, m, v
            seg_steps, offset = [], 0
            for (i, start, end), slot in zip(segments, slots, strict=True):
                state = states[i]
                stored = (params[i].view(-1), grads[i], state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
                for k in range(4):
                    sources[k].append(stored[k][start:end])
                for k in range(width):
                    views[k].append(scratch[k * n + offset:k * n + offset + end - start])
                offset += slot
                seg_steps.append(state["step"])
                base = (self.seed, state["salt"], state["draws"], start)
                for k in range(3):
                    keys[k].append(noise_key(*base, 2 + k) % NOISE_OFFSETS)
            m32, v32 = (views[2], views[3]) if lean else (sources[2], sources[3])
            torch._foreach_copy_([t for vs in views for t in vs], [t for ss in sources[:width] for t in ss])
            torch._fused_adamw_(views[0], views[1], m32, v32, [], seg_steps, lr=group["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                maximize=False, grad_scale=None, found_inf=found_inf)
            rounded = views[0] + (views[2] + views[3] if lean else [])
            offsets = keys[0] + (keys[1] + keys[2] if lean else [])
            table = noise_table(device, max(t.numel() for t in rounded))
            noise = [table[k:k + t.numel()] for k, t in zip(offsets, rounded, strict=True)]
            # Stochastic rounding (as BF16StateAdamW's moments): adding to the bit pattern carries into the kept
            # bits with probability (dropped bits) / 2**16; the mask drops the rest, so the copy back is exact.
            # NOTE: a weight within one bf16 ulp of fp32's largest finite value may round up to inf.
            torch._foreach_add_([t.view(torch.int32) for t in rounded], noise)
            scratch[:n].view(torch.int32).bitwise_and_(-65536)
            if lean:
                scratch[2 * n:4 * n].view(torch.int32).bitwise_and_(-65536)
            targets = sources[0] + (sources[2] + sources[3] if lean else [])
            torch._foreach_copy_(targets, rounded)


def check_pure_bf16_moments(state_precision: object) -> None:
    """ConfigError for moments pure bf16 cannot keep: int8 (bitsandbytes rounds the bf16 weight to nearest)."""
    if state_precision in PURE_BF16_MOMENTS:
        return
    fix = (f"pass {arg('state_precision', 'bf16')} (4 bytes per parameter) or 'fp32' (8) with pure bf16, or drop "
           f"{arg('pure_bf16')} (an "
           "fp32 master with int8 moments)")
    int8 = PURE_BF16_INT8.problem(SetUp(pure_bf16=True, state_precision=state_precision), Terms(fixes={
        PURE_BF16_INT8.name: fix}))
    if int8:
        raise ConfigError(int8)
    raise ConfigError(f"pure bf16 with {arg('state_precision', state_precision)}: To resolve this error, {fix}.")
