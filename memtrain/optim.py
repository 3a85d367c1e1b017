"""Lean AdamW: optimizer-state precision, step-in-backward, partial host offload, one builder, one byte model.

AdamW holds 16 bytes per fp32 parameter on the device (weights, gradient, two moments). Each option here trades
a little time or precision for some of them, and ``build_optimizer`` combines them into one
``torch.optim.Optimizer`` that LR schedulers, ``GradientAccumulator``, clipping, ``state_dict`` and the fp16
``GradScaler`` accept:

- ``state_precision``: the two moments in fp32 (8 bytes/param), bf16 (4: our ``BF16StateAdamW``, stochastic
  rounding, fp32 master kept) or int8 (about 2.03: bitsandbytes' block-wise 8-bit AdamW, the ``lowbit`` extra;
  tensors under 4,096 elements keep fp32 moments, as bitsandbytes and torchao do).
- ``step_in_backward``: each parameter steps as soon as its gradient is final and the gradient is freed at once,
  so the whole model's gradients never coexist (4 bytes/param less at the backward's peak). One backward pass:
  clipping uses the previous window's norm (lagged clipping), an fp16 overflow stops the parameters not yet
  stepped (see ``LeanAdamW``).
- ``offload_fraction``: that share of the parameters (the last ones in registration order, whose gradients land
  first in backward) keep their fp32 master and state in host RAM through ``CPUOffloadOptimizer``.

``optimizer_memory`` gives the bytes of each option without building anything (for ``estimate`` and the
planner); it equals what ``memtrain.measure.optimizer_state_bytes`` counts for the built optimizer.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from memtrain.errors import ConfigError, MemtrainError
from memtrain.precision import step_with_inf_flag

StatePrecision = Literal["fp32", "bf16", "int8"]
STATE_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8")
# bitsandbytes (and torchao) keep fp32 moments for tensors under this many elements: biases and norms are few
# bytes and sensitive to quantisation error.
INT8_MIN_NUMEL = 4096
INT8_BLOCK = 256  # elements per block-wise quantisation scale (one fp32 absmax per block and moment)
QMAP_BYTES = 2 * 256 * 4  # the signed and unsigned 8-bit code books, fp32, once per bitsandbytes optimizer
LOWBIT_EXTRA = "pip install 'memtrain[lowbit]'"
# Elements per pass of BF16StateAdamW's step, all the parameters of the pass together: the fp32 copies of the
# moments (8 bytes an element) live only for one pass.
BF16_CHUNK = {"cuda": 1 << 24, "cpu": 1 << 18}
INT8_DEVICES = ("cpu", "cuda")


# -- bf16 moments -------------------------------------------------------------------------------------------
_WEYL = 0x9E3779B1 - (1 << 32)  # 2**32 / golden ratio, odd, as signed int32
_OFFSETS = 1 << 16  # a segment's rounding noise starts at an offset in [0, _OFFSETS) of the noise table
_ALIGN = 16  # elements: segments start 64-byte aligned in the scratch and in their tensors (vectorised loads)
_INDEX: dict[torch.device, torch.Tensor] = {}  # the noise table per device (see _noise_table)


def _noise_table(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel + _OFFSETS`` int32 values of rounding noise in [0, 2**16), cached per device: entry k is
    the high 16 bits of k x a Weyl constant, mod 2**32.

    A segment of n elements reads n consecutive entries from an offset its key picks in [0, 2**16): across steps
    (a fresh key each) an element's noise runs over 2**16 consecutive terms of a Weyl sequence, whose high bits
    are uniform to within about 1e-4 of a bucket: that is what makes the rounding unbiased. Slicing the table
    costs no kernel, so the noise of a whole pass is one multi-tensor add. NOTE: relies on int32 arithmetic
    wrapping, as torch's kernels do. Grows (to a power of two, at most BF16_CHUNK + _OFFSETS) when a longer
    segment comes.
    """
    table = _INDEX.get(device)
    if table is None or table.numel() < numel + _OFFSETS:
        length = (1 << max(numel - 1, 1).bit_length()) + _OFFSETS
        h = torch.arange(length, dtype=torch.int32, device=device).mul_(_WEYL)
        table = _INDEX[device] = torch.bitwise_right_shift(h, 16).bitwise_and_(0xFFFF)
    return table


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW with both moments stored in bf16: 4 bytes per parameter instead of 8, on fp32 parameters.

    Trade-off: the update is torch's fused AdamW kernel in fp32 on fp32 copies of the moments, then the moments
    are rounded back to bf16 stochastically; against fused fp32 AdamW that is four more multi-tensor kernels per
    pass (copy in, add the rounding noise, drop the low bits, copy out) and about 3.3x its bytes moved (92 bytes
    per parameter instead of 28: 12 copying in, 28 in the kernel, 24 adding the noise, 16 masking, 12 copying
    out). Parameters must be fp32: they are the master weights.

    One step is one pass over all the parameters of a group on a device (multi-tensor ops, no per-parameter
    loop), or several when they hold more than ``BF16_CHUNK`` elements: a pass takes up to that many elements,
    splitting a parameter where the budget ends, so the fp32 copies (8 bytes an element) stay bounded.

    Rounding: the fp32 moment's bit pattern plus noise in [0, 2**16), then the low 16 bits dropped: it rounds
    away from zero with probability (dropped bits) / 2**16, unbiased in expectation, so the second moment keeps
    moving when beta2's update (1e-3 of it) is below bf16's half ulp (2**-9); an unchanged moment stays exact.

    Args:
        params: fp32 parameters or groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        seed: seeds the rounding noise, drawn per (parameter, step), so a resumed run rounds as the straight one.

    Raises:
        MemtrainError: at ``step()``, a parameter or gradient that is not fp32, a non-contiguous parameter, or a
            device without torch's fused AdamW kernel.
    """

    state_bytes_per_param = 4  # read by CPUOffloadOptimizer's host-RAM check
    # torch's fused AdamW protocol: GradScaler.step() hands over grad_scale and found_inf instead of unscaling and
    # checking itself (a host sync); the kernel unscales and skips on its own.
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.seed = int(seed)
        self._salts = 0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then the moments back to bf16 (lossless): ``Optimizer.load_state_dict`` casts every floating
        state tensor to its parameter's dtype, which would keep them in fp32 (8 bytes per parameter) unnoticed. A
        state saved by torch's AdamW (fp32 moments) is rounded to nearest and gets fresh rounding counters."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)
            state["exp_avg"] = state["exp_avg"].to(torch.bfloat16, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.bfloat16, memory_format=torch.contiguous_format)
            if "salt" not in state:
                state["draws"], state["salt"] = 0, self._salts
                self._salts += 1
        self._salts = max((s["salt"] + 1 for s in self.state.values()), default=self._salts)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    self._check(p)
                    by_device.setdefault(p.device, []).append(p)
            for device, params in by_device.items():
                self._step_device(group, params, device, grad_scale, found_inf)
        return loss

    def _check(self, p: torch.Tensor) -> None:
        if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
            raise MemtrainError(
                f"BF16StateAdamW steps fp32 parameters (the master weights), got a {p.dtype} parameter with a "
                f"{p.grad.dtype} gradient. To resolve this error, keep trainable weights in fp32 (autocast "
                "computes in bf16), or offload the optimizer (it keeps an fp32 master of bf16 weights).")
        if not p.is_contiguous():
            raise MemtrainError(
                f"BF16StateAdamW steps contiguous parameters (its passes slice them flat), got one of shape "
                f"{tuple(p.shape)} with strides {p.stride()}. To resolve this error, make the parameter contiguous "
                "(p.data = p.data.contiguous()) before building the optimizer, or use state_precision='fp32'.")
        if p.device.type not in torch.utils._foreach_utils._get_fused_kernels_supported_devices():
            raise MemtrainError(
                f"BF16StateAdamW runs torch's fused AdamW kernel, which has no {p.device.type!r} implementation. "
                "To resolve this error, train on a CPU or CUDA device, or use state_precision='fp32'.")
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
            state["draws"] = 0
            state["salt"] = self._salts
            self._salts += 1
        elif state["step"].device != p.device:  # e.g. loaded from a for-loop AdamW's state (CPU step counters)
            state["step"] = state["step"].to(p.device, torch.float32)

    def _step_device(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)  # once per parameter, however many passes its segments fall in
        if grad_scale is not None:  # GradScaler keeps them on its device; the kernel reads them on ours
            grad_scale = grad_scale.to(device, non_blocking=True)
        if found_inf is not None:
            found_inf = found_inf.to(device, non_blocking=True)
        beta1, beta2 = group["betas"]
        chunk = BF16_CHUNK.get(device.type, 1 << 20)
        grads = [p.grad.contiguous().view(-1) for p in params]
        # The fp32 moments of one pass: [exp_avg of every segment | exp_avg_sq of every segment], each segment in
        # a slot of a multiple of _ALIGN elements so that every one starts aligned for vectorised loads.
        scratch = torch.empty(2 * min(sum(_padded(p.numel()) for p in params), chunk), dtype=torch.float32,
                              device=device)
        for segments in _passes([p.numel() for p in params], chunk):
            slots = [_padded(end - start) for _, start, end in segments]
            n = sum(slots)
            ps, gs, m16, v16, seg_steps = [], [], [], [], []
            m32, v32 = [], []
            keys_m, keys_v = [], []
            offset = 0
            for (i, start, end), slot in zip(segments, slots, strict=True):
                p, state = params[i], states[i]
                ps.append(p.view(-1)[start:end])
                gs.append(grads[i][start:end])
                m16.append(state["exp_avg"].view(-1)[start:end])
                v16.append(state["exp_avg_sq"].view(-1)[start:end])
                m32.append(scratch[offset:offset + end - start])
                v32.append(scratch[n + offset:n + offset + end - start])
                offset += slot
                seg_steps.append(state["step"])
                # Counter-based noise: it depends on (seed, parameter, step, segment start) only, not on what ran
                # before, so a resumed run (draws and salt are in the state) rounds as the straight one.
                base = (self.seed, state["salt"], state["draws"], start)
                keys_m.append(_key(*base, 0) % _OFFSETS)
                keys_v.append(_key(*base, 1) % _OFFSETS)
            torch._foreach_copy_(m32 + v32, m16 + v16)
            torch._fused_adamw_(ps, gs, m32, v32, [], seg_steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                maximize=False, grad_scale=grad_scale, found_inf=found_inf)
            table = _noise_table(device, max(t.numel() for t in m32))
            noise = [table[k:k + t.numel()] for k, t in zip(keys_m + keys_v, m32 + v32, strict=True)]
            # Stochastic rounding: adding to the bit pattern carries into the kept bits with probability
            # (dropped bits) / 2**16; the mask drops the rest, so the copy back to bf16 is exact.
            torch._foreach_add_([t.view(torch.int32) for t in m32 + v32], noise)
            scratch[:2 * n].view(torch.int32).bitwise_and_(-65536)
            torch._foreach_copy_(m16 + v16, m32 + v32)
        for state in states:
            state["draws"] += 1
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))  # a skipped step does not count (as torch's)


def _passes(numels: Sequence[int], chunk: int, align: int = _ALIGN) -> list[list[tuple[int, int, int]]]:
    """Splits tensors of ``numels`` elements, in order, into passes of at most ``chunk`` elements:
    ``(tensor index, start, end)`` segments, a tensor cut where a pass's budget ends. Each segment takes its
    length rounded up to ``align`` (its slot in the scratch), so cuts and slots fall on multiples of ``align``."""
    chunk = max(align, chunk // align * align)
    passes: list[list[tuple[int, int, int]]] = []
    segments: list[tuple[int, int, int]] = []
    room = chunk
    for i, numel in enumerate(numels):
        start = 0
        while start < numel:
            end = min(numel, start + room)
            segments.append((i, start, end))
            room -= _padded(end - start, align)
            start = end
            if room == 0:
                passes.append(segments)
                segments, room = [], chunk
    if segments:
        passes.append(segments)
    return passes


def _padded(numel: int, align: int = _ALIGN) -> int:
    return -(-numel // align) * align


def _key(*parts: int) -> int:
    """A 31-bit key from integers, stable across processes (Python's hash of ints and tuples of ints is)."""
    return hash(parts) & 0x7FFFFFFF


# -- int8 moments (bitsandbytes, optional) ------------------------------------------------------------------
_ADAMW8BIT: type[torch.optim.Optimizer] | None = None


def adamw_8bit_class(device_type: str = "cpu") -> type[torch.optim.Optimizer]:
    """bitsandbytes' block-wise 8-bit AdamW (the ``lowbit`` extra), without its per-parameter device sync.

    Raises:
        ConfigError: bitsandbytes is not installed, or ``device_type`` has no 8-bit kernel (the error names the
            bf16 fallback).
    """
    global _ADAMW8BIT
    if device_type not in INT8_DEVICES:
        raise ConfigError(
            f"state_precision='int8' on a {device_type!r} device: bitsandbytes' 8-bit AdamW runs on "
            f"{' and '.join(INT8_DEVICES)} only. To resolve this error, pass state_precision='bf16' (4 bytes per "
            "parameter, no extra needed) or train on a CUDA device.")
    if _ADAMW8BIT is not None:
        return _ADAMW8BIT
    try:
        bnb_logger = logging.getLogger("bitsandbytes")
        level = bnb_logger.level
        bnb_logger.setLevel(logging.ERROR)  # its import logs optional kernels it did not find
        try:
            import bitsandbytes as bnb
        finally:
            bnb_logger.setLevel(level)
    except ImportError as e:
        raise ConfigError(
            f"state_precision='int8' needs bitsandbytes, which is not importable here ({e}). To resolve this error, "
            f"{LOWBIT_EXTRA}, or pass state_precision='bf16' (4 bytes per parameter, no extra needed).") from None

    class AdamW8bit(bnb.optim.AdamW8bit):
        """bitsandbytes.optim.AdamW8bit whose step() does not synchronise the device after every parameter.

        NOTE: bitsandbytes' own loop calls torch.cuda.synchronize() per parameter (for its paged buffers, unused
        here): that stalls the host once per tensor and, inside backward, serialises it with the GPU.
        """

        state_bytes_per_param = 2.04  # codes + one fp32 scale per 256; read by CPUOffloadOptimizer's RAM check

        def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8, weight_decay: float = 1e-2):
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             min_8bit_size=INT8_MIN_NUMEL, is_paged=False)

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if not self.initialized:
                self.check_overrides()
                self.to_gpu()
                self.initialized = True
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    if not self.state[p]:
                        self.init_state(group, p, gindex, pindex)
                    self.update_step(group, p, gindex, pindex)
            return loss

    _ADAMW8BIT = AdamW8bit
    return AdamW8bit


def _state_class(precision: str, device_type: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class holding moments of ``precision`` on ``device_type``, and its implementation kwargs."""
    if precision == "fp32":
        return torch.optim.AdamW, ({"fused": True} if device_type in ("cpu", "cuda") else {"foreach": False})
    if precision == "bf16":
        return BF16StateAdamW, {}
    return adamw_8bit_class(device_type), {}


def _check_precision(state_precision: object) -> None:
    if state_precision not in STATE_PRECISIONS:
        raise ConfigError(f"state_precision={state_precision!r} is not one of {list(STATE_PRECISIONS)}. To resolve "
                          "this error, pass 'fp32' (8 bytes per parameter), 'bf16' (4) or 'int8' (about 2).")


# -- converting a state between precisions ------------------------------------------------------------------
def _dequantize_8bit(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' block-wise dequantisation in plain torch: code book value x the block's absmax."""
    flat = qmap.to(codes.device)[codes.reshape(-1).long()]
    pad = -flat.numel() % INT8_BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK) * absmax.to(flat.device).view(-1, 1)
    return blocks.view(-1)[:flat.numel()].view(codes.shape)


def moments_of(entry: dict[str, Any]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(step, exp_avg, exp_avg_sq) in fp32 from an AdamW state entry of any precision: torch's (fp32), ours (bf16)
    or bitsandbytes' (``state1``/``state2``, 8-bit codes with block scales or fp32)."""
    if "exp_avg" in entry:
        return float(entry["step"]), entry["exp_avg"].float(), entry["exp_avg_sq"].float()
    if "state1" in entry:
        m, v = entry["state1"], entry["state2"]
        if m.dtype == torch.uint8:
            m = _dequantize_8bit(m, entry["absmax1"], entry["qmap1"])
            v = _dequantize_8bit(v, entry["absmax2"], entry["qmap2"])
        return float(entry["step"]), m.float(), v.float()
    raise ConfigError(f"an optimizer state entry with keys {sorted(entry)} is not AdamW's (exp_avg/exp_avg_sq, or "
                      "bitsandbytes' state1/state2). To resolve this error, load a state saved by AdamW.")


def precision_of(entry: dict[str, Any]) -> str:
    """The state precision an AdamW state entry was saved in: "int8" (bitsandbytes' keys), "bf16" or "fp32"."""
    if "state1" in entry:
        return "int8"
    return "bf16" if entry.get("exp_avg", torch.zeros(())).dtype == torch.bfloat16 else "fp32"


def _adopt(inner: torch.optim.Optimizer, p: torch.Tensor, entry: dict[str, Any]) -> dict[str, Any]:
    """A saved entry of ``inner``'s own precision, as is (bit-identical resume: the bf16 rounding counters and the
    8-bit codes are kept), its tensors moved to the parameter's device."""
    out = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
    out.pop("master_weight", None)
    if isinstance(inner, torch.optim.AdamW):
        fused = bool(inner.defaults.get("fused")) or bool(inner.defaults.get("capturable"))
        out["step"] = out["step"].to(p.device if fused else "cpu", torch.float32)
        out["exp_avg"], out["exp_avg_sq"] = out["exp_avg"].to(p.device), out["exp_avg_sq"].to(p.device)
        return out
    for k, v in out.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(p.device)
    if "qmap1" in out:  # the optimizer's own code books, shared by its parameters (as bitsandbytes does)
        for i, name in ((1, "dynamic"), (2, "udynamic")):
            inner.name2qmap[name] = inner.name2qmap[name].to(p.device)
            out[f"qmap{i}"] = inner.name2qmap[name]
    return out


def _entry_for(inner: torch.optim.Optimizer, p: torch.Tensor, moments: tuple[float, torch.Tensor, torch.Tensor],
               salt: int) -> dict[str, Any]:
    """A state entry in ``inner``'s own format for parameter ``p`` holding ``moments`` (requantised if 8-bit)."""
    step, m, v = moments
    m, v = m.to(p.device, torch.float32).view(p.shape), v.to(p.device, torch.float32).view(p.shape)
    if isinstance(inner, torch.optim.AdamW):
        fused = bool(inner.defaults.get("fused")) or bool(inner.defaults.get("capturable"))
        step_t = torch.tensor(step, dtype=torch.float32, device=p.device if fused else "cpu")
        return {"step": step_t, "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    if isinstance(inner, BF16StateAdamW):
        fused = p.device.type in ("cpu", "cuda")
        step_t = torch.tensor(step, dtype=torch.float32, device=p.device if fused else "cpu")
        return {"step": step_t, "exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16(), "draws": 0, "salt": salt}
    # bitsandbytes: its init_state gives the layout (8-bit codes or fp32 by size), then the moments fill it.
    import bitsandbytes.functional as bnbf

    gindex = next(i for i, g in enumerate(inner.param_groups) if any(q is p for q in g["params"]))
    pindex = next(i for i, q in enumerate(inner.param_groups[gindex]["params"]) if q is p)
    inner.state[p] = {}
    inner.init_state(inner.param_groups[gindex], p, gindex, pindex)
    entry = inner.state[p]
    entry["step"] = int(step)
    if entry["state1"].dtype == torch.uint8:
        for i, moment in ((1, m), (2, v)):
            codes, quant = bnbf.quantize_blockwise(moment.contiguous(), code=entry[f"qmap{i}"],
                                                   blocksize=INT8_BLOCK)
            entry[f"state{i}"].copy_(codes)
            entry[f"absmax{i}"].copy_(quant.absmax)
    else:
        entry["state1"].copy_(m)
        entry["state2"].copy_(v)
    return entry


# -- which parameters go to the host ------------------------------------------------------------------------
def offloaded_mask(numels: Sequence[int], fraction: float) -> list[bool]:
    """Which parameters (in registration order) a partial offload puts on the host: the shortest run of the
    *last* ones holding at least ``fraction`` of the elements. Their gradients land first in backward, so their
    CPU step starts earliest and the next forward needs their weights last.

    Raises:
        ConfigError: ``fraction`` outside [0, 1].
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"offload_fraction={fraction!r} must be a number in [0, 1] (0: all state on the device, "
                          "1: all on the host). To resolve this error, pass e.g. offload_fraction=0.5.")
    total = sum(numels)
    mask = [False] * len(numels)
    if fraction <= 0 or total == 0:
        return mask
    held = 0
    for i in reversed(range(len(numels))):
        if held >= fraction * total:
            break
        mask[i] = True
        held += numels[i]
    return mask


# -- the byte model -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerMemory:
    """Bytes an optimizer built by ``build_optimizer`` holds, predicted without building it.

    Attributes:
        device_state_bytes: optimizer state on the device after the first step (moments, step counters, 8-bit
            scales and code books).
        device_gradient_bytes: the device gradients held between micro-batches of a window (0 for offloaded
            parameters, whose gradients stream to the host).
        device_gradient_peak_bytes: live device gradient bytes at the backward's peak: with step-in-backward and
            one micro-batch per step, the largest device parameter's gradient; else ``device_gradient_bytes``.
        device_step_temp_bytes: transient device bytes of the step (an upper bound: bf16 moments' fp32 chunk
            copies and rounding noise; step-in-backward's one pass adds none).
        host_state_bytes: optimizer state in host RAM (offloaded parameters).
        host_bytes: everything in host RAM: fp32 masters, gradient buffers, cast and gradient stage buffers
            (non-fp32 device weights) and state.
        offloaded_params: parameters (tensors) whose state is on the host.
    """

    device_state_bytes: int
    device_gradient_bytes: int
    device_gradient_peak_bytes: int
    device_step_temp_bytes: int
    host_state_bytes: int
    host_bytes: int
    offloaded_params: int

    @property
    def state_bytes(self) -> int:
        """All optimizer state, device and host: what ``measure.optimizer_state_bytes`` counts."""
        return self.device_state_bytes + self.host_state_bytes


def _state_bytes(numel: int, dtype: torch.dtype, precision: str) -> int:
    """One parameter's state bytes, code books excluded (they are shared per optimizer)."""
    if precision == "fp32":
        return 4 + 2 * numel * torch.empty((), dtype=dtype).element_size()  # step (fp32 scalar), two moments
    if precision == "bf16":
        return 4 + 2 * numel * 2
    if numel < INT8_MIN_NUMEL:
        return 2 * numel * 4  # bitsandbytes' fp32 moments; its step counter is a Python int
    return 2 * numel + 2 * 4 * -(-numel // INT8_BLOCK)


def optimizer_memory(params: Sequence[tuple[int, torch.dtype]], *, state_precision: str = "fp32",
                     offload_fraction: float = 0.0, step_in_backward: bool = False, accumulation_steps: int = 1,
                     delayed_update: bool = False, device_type: str = "cuda") -> OptimizerMemory:
    """The bytes of ``build_optimizer(...)`` over trainable parameters ``(numel, dtype)`` in registration order.

    Pure: builds nothing, so it serves ``estimate`` and the planner on configs of any size. Bytes per parameter
    of state: fp32 8, bf16 4, int8 2 + 8/256 (tensors of at least 4,096 elements; smaller ones 8), plus 4 bytes of
    step counter per tensor (fp32 and bf16) and 2 KiB of code books per bitsandbytes optimizer.

    Example:
        >>> m = optimizer_memory([(4096 * 4096, torch.float32)], state_precision="int8")
        >>> round(m.device_state_bytes / (4096 * 4096), 3)
        2.031
    """
    from memtrain.optim_offload import CPUOffloadOptimizer, _aligned, bucket_runs

    _check_precision(state_precision)
    numels = [int(n) for n, _ in params]
    on_host = offloaded_mask(numels, offload_fraction)
    device = [(n, dt) for (n, dt), h in zip(params, on_host, strict=True) if not h]
    host = [(n, dt) for (n, dt), h in zip(params, on_host, strict=True) if h]

    def qmaps(groups: list[list[tuple[int, torch.dtype]]]) -> int:
        if state_precision != "int8":
            return 0
        return QMAP_BYTES * sum(any(n >= INT8_MIN_NUMEL for n, _ in g) for g in groups)

    device_state = sum(_state_bytes(n, dt, state_precision) for n, dt in device)
    # One optimizer over the device parameters, or one per parameter with step-in-backward.
    device_state += qmaps([[p] for p in device] if step_in_backward else [device])
    # CPUOffloadOptimizer: fp32 masters (state in fp32 terms), buckets in reverse registration order.
    host_state = sum(_state_bytes(n, torch.float32, state_precision) for n, _ in host)
    host_rev = list(reversed(host))
    host_state += qmaps([[host_rev[i] for i in run]
                         for run in bucket_runs([n for n, _ in host_rev], CPUOffloadOptimizer.bucket_numel)])
    aligned = sum(_aligned(n) for n, _ in host)
    cast = sum(_aligned(n) * torch.empty((), dtype=dt).element_size() for n, dt in host if dt != torch.float32)
    # Non-fp32 device weights: a cast buffer and a gradient stage in their dtype.
    host_bytes = host_state + 4 * aligned * (2 + bool(delayed_update)) + 2 * cast if host else 0

    grad_bytes = [n * torch.empty((), dtype=dt).element_size() for n, dt in device]
    device_grads = sum(grad_bytes)
    peak = device_grads
    if step_in_backward and accumulation_steps == 1:
        peak = max(grad_bytes, default=0)
    largest = max((n for n, _ in device), default=0)
    temp = 0
    if state_precision == "bf16":
        # BF16StateAdamW: one pass's fp32 copies of both moments (its parameters cut at multiples of 16 elements,
        # one optimizer per parameter with step-in-backward), and the rounding-noise table it keeps per device
        # (a power of two over the longest piece, plus the offsets it reads at; built through one int32 temporary
        # of its size).
        chunk = BF16_CHUNK.get(device_type, 1 << 20)
        padded = [-(-n // 16) * 16 for n, _ in device]
        scratch = min(max(padded, default=0) if step_in_backward else sum(padded), chunk)
        temp = 8 * scratch + 2 * 4 * ((1 << max(min(largest, chunk) - 1, 1).bit_length()) + _OFFSETS)
    elif state_precision == "int8" and device_type == "cpu":
        temp = largest * 4 * 4  # bitsandbytes' CPU path dequantises whole tensors: moments, gradient, weights
    return OptimizerMemory(
        device_state_bytes=device_state, device_gradient_bytes=device_grads, device_gradient_peak_bytes=peak,
        device_step_temp_bytes=temp, host_state_bytes=host_state, host_bytes=host_bytes,
        offloaded_params=len(host))


def host_step_probe(state_precision: str, n_params: int) -> torch.optim.Optimizer:
    """A host AdamW with moments in ``state_precision`` over ``n_params`` parameters in 4 tensors, their gradients
    set (seeded): what ``cpu_step_rate`` and benchmarks/bench_optim_state.py time."""
    _check_precision(state_precision)
    cls, kwargs = _state_class(state_precision, "cpu")
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n_params // 4, generator=g) for _ in range(4)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return cls(params, lr=1e-4, **kwargs)


def cpu_step_rate(state_precision: str = "fp32", n_params: int = 1 << 22, repeats: int = 3) -> float:
    """Parameters per second of one host AdamW step with moments in ``state_precision`` (the planner's rate of
    CPUOffloadOptimizer's CPU step), measured here on ``n_params`` parameters in 4 tensors: median of
    ``repeats`` steps after one warm-up (which creates the state)."""
    opt = host_step_probe(state_precision, n_params)
    params = opt.param_groups[0]["params"]
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return sum(p.numel() for p in params) / sorted(times)[len(times) // 2]


# -- the optimizer ------------------------------------------------------------------------------------------
@dataclass
class _Arming:
    """How the next backward treats the device gradients (step-in-backward)."""

    last: bool = True  # False: a non-final micro-batch, gradients accumulate as usual
    # Multiplies the (unscaled) gradients first: the window's normalisation; a device tensor from the accumulator
    # (1 / items, not read back).
    grad_factor: float | torch.Tensor = 1.0
    max_norm: float | None = None  # clip the global norm to this
    scaler: torch.amp.GradScaler | None = None


class LeanAdamW(torch.optim.Optimizer):
    """AdamW over named parameters with a state precision, optional step-in-backward and partial host offload.

    Trade-off: see the module docstring; each option is off (fp32 state on the device, an ordinary step) unless
    asked for. Build it with ``build_optimizer``.

    With ``step_in_backward``, backward is where parameters step: the default arming steps every backward (a loop
    of ``loss.backward(); opt.step(); opt.zero_grad()`` works, with no clipping); ``GradientAccumulator`` arms each
    micro-batch itself (``prepare_backward``) and runs the last one through ``backward(loss)``. ``step()`` stays
    the explicit boundary: it checks that a backward stepped since the last one, steps the host part and
    reports ``last_grad_norm`` (a device tensor: reading it is the caller's host sync); it raises when no backward
    ran.

    Step-in-backward runs one backward pass per micro-batch, with clipping and with the fp16 scaler:

    - Clipping is *lagged*: window t's gradients are multiplied by ``min(1, max_norm / (norm_{t-1} + 1e-6))``,
      the coefficient of the last finite window norm before it, since a parameter steps before the later
      gradients (and so the window's norm) exist. The first window has no previous norm and is not clipped: AdamW's
      first update is ``g / (|g| + eps)`` per element, whatever the gradient's scale, so only its moments carry the
      unclipped magnitude. ``last_grad_norm`` is the window's own norm before clipping, as ``clip_grad_norm_``
      returns it. A two-pass scheme (norm first, steps in a second backward) was exact but cost a second backward
      every step and broke torch's native chunked loss, whose backward runs once.
    - NOTE: an inf/nan gradient (fp16 overflow, or any non-finite gradient) sets a flag on the device as that
      gradient lands; fused AdamW reads it and no parameter steps after it (weights, moments, step count as they
      were), with no host sync. Parameters whose gradients landed *before* it took this step with their finite
      gradients: the compromise of stepping in one pass. The scaler then backs off as usual and the window counts
      as skipped. Inner optimizers without that flag (bf16 and int8 moments) are refused with an fp16 scaler.
    """

    _OPTIONS = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, state_precision: str, offload_mask: Sequence[bool],
                 step_in_backward: bool, grad_scaler: torch.amp.GradScaler | None):
        from memtrain.optim_offload import CPUOffloadOptimizer

        names = [n for n, _ in named_params]
        params = [p for _, p in named_params]
        hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.state_precision = state_precision
        self.steps_in_backward = step_in_backward
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self._names = {id(p): n for n, p in named_params}
        self._device_params = [p for p, h in zip(params, offload_mask, strict=True) if not h]
        host_named = [(n, p) for n, p, h in zip(names, params, offload_mask, strict=True) if h]
        device_type = params[0].device.type
        cls, impl = _state_class(state_precision, device_type)
        self._adding = True
        super().__init__([{"params": params, "param_names": names, **hyper}], hyper)
        self._adding = False
        self._inner: dict[int, torch.optim.Optimizer] = {}  # id(device parameter) -> the optimizer stepping it
        if self._device_params:
            if step_in_backward:
                for p in self._device_params:
                    self._inner[id(p)] = cls([p], **hyper, **impl)
            else:
                shared = cls(self._device_params, **hyper, **impl)
                self._inner.update({id(p): shared for p in self._device_params})
        self._host = None
        if host_named:
            host_cls, host_impl = _state_class(state_precision, "cpu")
            self._host = CPUOffloadOptimizer(host_named, optimizer_class=host_cls, **hyper, **host_impl)
        # With host gradients the accumulator normalises and clips through us (scale_gradients_, clip_grad_norm_),
        # and GradScaler hands its inf check to step() (as with CPUOffloadOptimizer).
        self.manages_gradients = self._host is not None and not step_in_backward
        # Whether step() skips on a device flag (found_inf) with no host sync: every part is torch's fused AdamW.
        self.takes_skip_flag = self._host is None and not step_in_backward and all(
            getattr(o, "_step_supports_amp_scaling", False) for o in self._inner.values())
        self._step_supports_amp_scaling = self._host is not None or step_in_backward
        self.last_grad_norm: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None
        self._device_found: torch.Tensor | None = None  # fp16: the device gradients' inf check (host part)
        self._gathered = False
        self._arming = _Arming(scaler=self.grad_scaler)
        self._backward_ran = False  # a backward stepped since the last step()
        self._norms: dict[int, torch.Tensor] = {}  # this window's per-parameter norms (device tensors)
        # The last finite window norm: it clips the next window (lagged clipping). 0 before any: no clipping.
        self._lagged_norm = torch.zeros(())
        self.window_found_inf: torch.Tensor | None = None  # the last window's inf/nan flag (step-in-backward)
        # Per device, for one window's backward: the inf flag, the inverse scale and the clip coefficient, kept
        # on the device so that no hook synchronises with the host.
        self._on_device: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._synced = False  # the inner optimizers hold param_groups' hyper-parameters of this step
        self._hooks = []
        if step_in_backward:
            # The hooks hold the optimizer weakly: a dropped optimizer must not keep stepping in backward.
            owner = weakref.ref(self)
            for p in self._device_params:
                self._hooks.append(p.register_post_accumulate_grad_hook(_post_hook(owner)))
            weakref.finalize(self, _remove_hooks, self._hooks)
        self._link_state()

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_adding", False):
            raise MemtrainError("LeanAdamW.add_param_group: the inner optimizers are built once. To resolve this "
                                "error, pass every parameter to build_optimizer.")
        super().add_param_group(param_group)

    def _link_state(self) -> None:
        # optimizer.state[p] is the inner optimizers' own dict, so measure.optimizer_state_bytes and tools that
        # inspect optimizer.state see every byte (device and host).
        self.state.clear()
        for p in self._device_params:
            self.state[p] = self._inner[id(p)].state[p]
        if self._host is not None:
            for slot in self._host._slots:
                self.state[slot.device] = self._host.state[slot.device]

    def _sync_hyperparameters(self) -> None:
        group = self.param_groups[0]
        values = {k: group[k] for k in self._OPTIONS}
        for inner in {id(o): o for o in self._inner.values()}.values():
            for g in inner.param_groups:
                g.update(values)
        if self._host is not None:
            for g in self._host.param_groups:
                g.update(values)

    def _device_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._device_params if p.grad is not None]

    # -- host gradients: normalise, clip, unscale (the accumulator's path for CPUOffloadOptimizer) ---------------
    def _gather(self) -> None:
        if self._gathered:
            return
        if self._host is not None:
            self._host._gather()
        self._found_inf = None
        self._device_found = None
        if self.grad_scaler is not None and not self.steps_in_backward:
            state = self.grad_scaler._per_optimizer_states[id(self)]
            if state["stage"].name == "UNSCALED":
                raise MemtrainError(
                    "scaler.unscale_(optimizer) was called, but part of this optimizer's gradients live on the host "
                    "where the scaler cannot see them. To resolve this error, remove scaler.unscale_(optimizer) and "
                    "call optimizer.clip_grad_norm_(max_norm), which unscales first (GradientAccumulator does).")
            inv = self.grad_scaler._scale.double().reciprocal().float()
            found = torch.zeros((), dtype=torch.float32, device=inv.device)
            device_grads = self._device_grads()
            if device_grads:
                torch._amp_foreach_non_finite_check_and_unscale_(device_grads, found, inv)
            self._device_found = found
            if self._host is not None:
                # No pass over the host gradients: the inverse scale joins the host step's multiplier, and their
                # inf check is their norm's.
                self._host._inv_scale = inv.to("cpu", copy=True)
        self._gathered = True

    def _all_grads(self) -> list[torch.Tensor]:
        """This step's gradients in param_groups order: device ones in .grad, host ones in the host buffers."""
        host = {id(s.device): s.master for s in self._host._slots} if self._host is not None else {}
        out = []
        for p in self.param_groups[0]["params"]:
            g = host[id(p)].grad if id(p) in host else p.grad
            if g is not None:
                out.append(g)
        return out

    def next_backward_is_last(self) -> None:
        """The host part takes each gradient's norm as it lands in the next backward (the window's last), so that
        ``clip_grad_norm_`` reads no host gradient (see ``CPUOffloadOptimizer.next_backward_is_last``)."""
        if self._host is not None:
            self._host.next_backward_is_last()

    @torch.no_grad()
    def scale_gradients_(self, factor: float | torch.Tensor) -> None:
        """Multiplies this step's gradients by ``factor`` (a number, or a one-element host tensor: not read): the
        device ones in place, the host ones lazily (the host step applies it, see
        ``CPUOffloadOptimizer.scale_gradients_``)."""
        self._check_not_in_backward("scale_gradients_")
        self._gather()
        grads = self._device_grads()
        if grads and isinstance(factor, torch.Tensor):
            for device, group in _by_device(grads).items():
                torch._foreach_mul_(group, factor.to(device, torch.float32, non_blocking=True))
        elif grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)
        if self._host is not None:
            self._host.scale_gradients_(factor)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients (device and host) by their global norm, as ``torch.nn.utils.clip_grad_norm_``
        would if all of them were on the device; returns the norm before clipping (a CPU tensor). The host
        gradients are not read: their norms were taken as they landed, and the coefficient joins the host step's
        multiplier."""
        self._check_not_in_backward("clip_grad_norm_")
        self._gather()
        if self._host is None or norm_type != 2.0:
            grads = self._all_grads()
            if self._host is not None:
                self._host.gradients()  # applies the host multiplier: this norm reads the gradients
            if not grads:
                return torch.zeros(())
            total = torch.nn.utils.get_total_norm(grads, norm_type).cpu()
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for device, group in _by_device(grads).items():
                torch._foreach_mul_(group, coef.to(device))
            return total
        host = {id(s.device): s for s in self._host._slots}
        host_total, multiplier, host_found = self._host._window_scalars()
        scale = multiplier.abs() if isinstance(multiplier, torch.Tensor) else abs(multiplier)
        device_grads = self._device_grads()
        # The device norms cross in one blocking copy per device: a non-blocking copy to the host returns before
        # its data arrives, and they are combined on the host right below.
        norm_of: dict[int, torch.Tensor] = {}
        for group in _by_device(device_grads).values():
            for g, norm in zip(group, torch.stack(torch._foreach_norm(group, 2.0)).cpu().unbind(), strict=True):
                norm_of[id(g)] = norm
        norms = []
        for p in self.param_groups[0]["params"]:  # param_groups order, as torch stacks them
            slot = host.get(id(p))
            if slot is None:
                if p.grad is not None:
                    norms.append(norm_of[id(p.grad)])
            elif slot.master.grad is not None:
                norm = slot.norm if slot.norm is not None else torch.linalg.vector_norm(slot.master.grad, 2.0)
                norms.append((norm.double() * scale).float() if isinstance(scale, torch.Tensor) else norm * scale)
        if not norms:
            return torch.zeros(())
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for device, group in _by_device(device_grads).items():
            torch._foreach_mul_(group, coef.to(device))
        self._host._scalars = (host_total, coef.double() * multiplier, torch.maximum(host_found,
                                                                                    (~total.isfinite()).float()))
        return total

    def _check_not_in_backward(self, what: str) -> None:
        if self.steps_in_backward:
            raise MemtrainError(
                f"{what} on a step-in-backward optimizer: the device parameters stepped during backward, so there "
                "is no gradient left to change. To resolve this error, pass the normalisation and the clipping "
                "before backward: GradientAccumulator(..., max_grad_norm=...) does it, or call "
                "optimizer.prepare_backward(grad_factor=..., max_norm=...) and optimizer.backward(loss).")

    # -- step-in-backward ---------------------------------------------------------------------------------------
    def prepare_backward(self, *, last: bool = True, grad_factor: float = 1.0, max_norm: float | None = None,
                         scaler: torch.amp.GradScaler | None = None) -> None:
        """Arms the next backward (step-in-backward only).

        Args:
            last: False for a micro-batch that is not the window's last: its gradients accumulate as usual.
            grad_factor: multiplies the unscaled gradients before clipping and stepping (e.g. 1 / items): a
                number, or a 0-d tensor (never read on the host).
            max_norm: clip with the coefficient of the *previous* window's norm (lagged clipping, see the class
                docstring); this window's norm is taken as its gradients step and clips the next one.
            scaler: the fp16 GradScaler whose scale the gradients carry: each is unscaled and checked as it
                lands, and no parameter steps once an inf/nan was seen.
        """
        if not self.steps_in_backward:
            raise MemtrainError("prepare_backward() on an optimizer built with step_in_backward=False: its step() "
                                "does the work. To resolve this error, build it with step_in_backward=True or drop "
                                "the call.")
        self._sync_hyperparameters()
        self._synced = True
        self._on_device.clear()
        factor = grad_factor if isinstance(grad_factor, torch.Tensor) else float(grad_factor)
        self._arming = _Arming(last=last, grad_factor=factor,
                               max_norm=None if max_norm is None or max_norm == math.inf else float(max_norm),
                               scaler=scaler if scaler is not None and scaler.is_enabled() else None)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagates ``loss`` as armed: one pass, the parameters stepping as their gradients are final.

        Kept so that callers need not know the arming: it is ``loss.backward()``.
        """
        loss.backward()

    def _inv_scale(self, scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
        return scaler._scale.double().reciprocal().float().to(device)  # as GradScaler.unscale_ computes it

    def _cached(self, device: torch.device, key: str) -> torch.Tensor:
        """Per device, for one window's backward: the inf flag, the inverse scale and the clip coefficient, made
        on the device once so that no hook synchronises with the host."""
        cache = self._on_device.setdefault(device, {})
        if key not in cache:
            if key == "found":
                cache[key] = torch.zeros((), dtype=torch.float32, device=device)
            elif key == "inv":
                cache[key] = self._inv_scale(self._arming.scaler, device)
            elif key == "factor":  # fp32, as a Python factor would be rounded for fp32 gradients
                # Blocking into host memory (the host gradients are multiplied right away); asynchronous onto a
                # device, where the multiply is queued behind the copy.
                cache[key] = self._arming.grad_factor.to(device, torch.float32, non_blocking=device.type != "cpu")
            else:  # "coef": lagged clipping, from the last finite window norm (0 before any: no clipping)
                lagged = self._lagged_norm.to(device, non_blocking=True)
                cache[key] = torch.clamp(self._arming.max_norm / (lagged + 1e-6), max=1.0)
        return cache[key]

    def _window_norm(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last backward: the global norm over device (from the hooks) and host gradients, in param order
        as torch's clip_grad_norm_ stacks them (another order can move the last bit), on the device; and the
        window's inf flag (None when nothing was checked)."""
        arming = self._arming
        host: dict[int, Any] = {}
        host_found = None
        if self._host is not None:
            self._host._gather()
            host = {id(s.device): s for s in self._host._slots}
            grads = [s.master.grad for s in self._host._slots if s.master.grad is not None]
            if grads and arming.scaler is not None:
                host_found = torch.zeros((), dtype=torch.float32)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, host_found,
                                                                 self._inv_scale(arming.scaler, grads[0].device))
            if grads:
                self._multiply_by_factor(grads)
        target = next(iter(self._norms.values())).device if self._norms else torch.device("cpu")
        norms = []
        for p in self.param_groups[0]["params"]:
            if id(p) in host:
                g = host[id(p)].master.grad
                if g is not None:
                    norms.append(torch._foreach_norm([g], 2.0)[0].to(target, non_blocking=True))
            elif id(p) in self._norms:
                norms.append(self._norms[id(p)].to(target, non_blocking=True))
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros((), device=target)
        flags = [c["found"].to(target, non_blocking=True) for c in self._on_device.values() if "found" in c]
        if host_found is not None:
            flags.append(host_found.to(target, non_blocking=True))
        found = torch.stack(flags).amax() if flags else None
        return total, found

    def _window_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as the step sees it, in place: unscaled (fp16), times the window's factor, in the
        accumulator's order of operations (the same kernels, so that the result is bit-identical to the ordinary
        path)."""
        arming = self._arming
        if arming.scaler is not None:
            torch._amp_foreach_non_finite_check_and_unscale_([grad], self._cached(grad.device, "found"),
                                                             self._cached(grad.device, "inv"))
        self._multiply_by_factor([grad])
        return grad

    def _multiply_by_factor(self, grads: list[torch.Tensor]) -> None:
        factor = self._arming.grad_factor
        if isinstance(factor, torch.Tensor):
            torch._foreach_mul_(grads, self._cached(grads[0].device, "factor"))
        elif factor != 1.0:
            torch._foreach_mul_(grads, factor)

    def _step_param(self, p: torch.Tensor) -> None:
        """Unscale, normalise, take the norm, clip (lagged), step this parameter, free its gradient: one pass."""
        if not self._synced:
            self._sync_hyperparameters()  # an LR scheduler stepped since: this backward steps with its lr
        grad = self._window_gradient(p.grad)
        norm = torch._foreach_norm([grad], 2.0)[0]
        self._norms[id(p)] = norm
        found = self._cached(grad.device, "found")
        # A non-finite gradient without a scaler is flagged too: no parameter steps after it (see the NOTE in
        # the class docstring), so weights never take nan from it. One scalar op, no host sync.
        torch.logical_or(found, norm.isfinite().logical_not(), out=found)
        if self._arming.max_norm is not None:
            torch._foreach_mul_([grad], self._cached(grad.device, "coef"))
        inner = self._inner[id(p)]
        step_with_inf_flag(inner, found if getattr(inner, "_step_supports_amp_scaling", False) else None)
        p.grad = None  # freed at once: the whole model's gradients never coexist
        self._backward_ran = True

    def _leftovers(self) -> list[torch.Tensor]:
        """Device parameters still holding a gradient after the last backward: no hook of it saw them (they were
        used only in earlier micro-batches of the window). They step at step(), like the rest."""
        return [p for p in self._device_params if p.grad is not None]

    # -- the step -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Steps what backward did not: the whole optimizer, or (step-in-backward) the host part; then the
        scaler's inf check is handed back (skipped steps change nothing)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaler = self._arming.scaler if self.steps_in_backward else self.grad_scaler
        if self.steps_in_backward:
            self._step_after_backward()
        else:
            self._step_ordinary()
        if self._found_inf is not None and scaler is not None:
            # NOTE: GradScaler has no public way to receive an inf check made elsewhere: scaler.update() reads it.
            scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {self._found_inf.device: self._found_inf}
        self._gathered = False
        return loss

    def _step_ordinary(self) -> None:
        self._sync_hyperparameters()
        if self._host is None:  # a plain optimizer: GradScaler.step() unscaled and checked the gradients
            flag = getattr(self, "found_inf", None)  # set by GradientAccumulator (or GradScaler): skip on it
            for inner in {id(o): o for o in self._inner.values()}.values():
                takes = getattr(inner, "_step_supports_amp_scaling", False)
                step_with_inf_flag(inner, flag if takes else None, getattr(self, "grad_scale", None))
            return
        self._gather()
        if self._device_found is not None:
            # fp16: the device gradients' inf check and the host ones' (their norm's), for the scaler and the skip.
            self._found_inf = self._device_found.to("cpu") + self._host.found_inf_flag
            if self._found_inf.item() > 0:
                return  # fp16 overflow: skipped, weights and state untouched
        for inner in {id(o): o for o in self._inner.values()}.values():
            inner.step()
        if self._host is not None:
            self._host.step()

    def _step_after_backward(self) -> None:
        if not self._backward_ran:
            raise MemtrainError(
                "step() on a step-in-backward optimizer with no backward since the last step(): the parameters step "
                "inside backward, so there is nothing to step. To resolve this error, call loss.backward() (or "
                "GradientAccumulator's micro-batches) before step().")
        arming = self._arming
        for p in self._leftovers():
            self._step_param(p)
        total, found = self._window_norm()
        self.last_grad_norm = total
        self.window_found_inf = found
        if self._host is not None:
            # NOTE: the host part steps after backward, so it can be clipped exactly and skipped on an inf: one
            # host sync (the norm and the flag in one copy), as the offloaded optimizer needs anyway.
            total_host, found_host = torch.stack([total, found if found is not None else torch.zeros_like(total)]
                                                 ).cpu().tolist()
            if found_host == 0 and math.isfinite(total_host):
                host_grads = [s.master.grad for s in self._host._slots if s.master.grad is not None]
                if arming.max_norm is not None and host_grads:
                    lagged = float(self._lagged_norm)
                    coef = min(1.0, arming.max_norm / (lagged + 1e-6))
                    if coef < 1.0:
                        torch._foreach_mul_(host_grads, coef)
                self._sync_hyperparameters()
                self._host.step()
        # The norm that clips the next window: this one's when finite (a skipped window leaves it as it was).
        finite = total.isfinite() if found is None else total.isfinite() & (found == 0)
        self._lagged_norm = torch.where(finite, total, self._lagged_norm.to(total.device, non_blocking=True))
        if arming.scaler is not None:
            self._found_inf = found if found is not None else torch.zeros((), device=total.device)
        self._backward_ran = False
        self._synced = False
        self._norms.clear()
        self._on_device.clear()
        self._arming = _Arming(scaler=self.grad_scaler)  # the default: every backward steps (plain loops)


    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # the device gradients
        self._norms.clear()
        if self._host is not None:
            self._host.zero_grad(set_to_none=set_to_none)
        self._gathered = False
        self._on_device.clear()
        if self._backward_ran:  # a window dropped without step() (discard_window): the next one starts afresh
            self._backward_ran = self._synced = False
            self._arming = _Arming(scaler=self.grad_scaler)

    # -- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state keyed by parameter name, each entry in its precision's own format (torch's AdamW keys for
        fp32 and bf16, bitsandbytes' for int8; ``master_weight`` for offloaded non-fp32 weights), plus
        ``state_precision``. ``load_state_dict`` of any precision converts it."""
        host_sd = self._host.state_dict() if self._host is not None else {"state": {}}
        state: dict[str, dict[str, Any]] = {}
        for p in self._device_params:
            entry = self.state.get(p)
            if entry:
                state[self._names[id(p)]] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                             for k, v in entry.items()}
        state.update(host_sd["state"])
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(group["param_names"])
        out = {"state": state, "param_groups": [group], "state_precision": self.state_precision}
        if self.steps_in_backward:
            out["lagged_grad_norm"] = float(self._lagged_norm)  # clips the next window: a resumed run clips alike
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state saved by this class (any state precision), by CPUOffloadOptimizer or by a plain AdamW with
        named parameters: entries are matched by name and converted to this optimizer's precision (fp32 <-> bf16
        casts, int8 dequantised or requantised block-wise). Load the model's weights first.

        Raises:
            ConfigError: unknown names, shape mismatches, or entries that are not AdamW state.
        """
        saved_groups = state_dict["param_groups"]
        saved_names = [n for g in saved_groups for n in g.get("param_names", g["params"])]
        keys = [k for g in saved_groups for k in g["params"]]
        by_key = dict(zip(keys, saved_names, strict=True))
        params = {n: p for n, p in zip(self.param_groups[0]["param_names"], self.param_groups[0]["params"],
                                       strict=True)}
        problems = []
        converted: dict[str, tuple[float, torch.Tensor, torch.Tensor]] = {}
        same: dict[str, dict[str, Any]] = {}  # entries already in this precision: loaded as they are
        masters: dict[str, torch.Tensor] = {}
        for key, entry in state_dict["state"].items():
            name = by_key.get(key, key)
            p = params.get(name)
            if p is None:
                problems.append(f"state entry {name!r} names no parameter of this optimizer.")
                continue
            try:
                step, m, v = moments_of(entry)
            except ConfigError as e:
                problems.append(f"{name!r}: {e}")
                continue
            if m.numel() != p.numel():
                problems.append(f"state of {name!r} holds {m.numel()} elements, the parameter {p.numel()}.")
                continue
            converted[name] = (step, m, v)
            if precision_of(entry) == self.state_precision:
                same[name] = entry
            if "master_weight" in entry:
                masters[name] = entry["master_weight"]
        if problems:
            problems[-1] += " To resolve this error, load a state_dict saved for the same model (named parameters)."
        ConfigError.raise_if(problems)
        saved_group = saved_groups[0]
        self.param_groups[0].update({k: saved_group[k] for k in self._OPTIONS if k in saved_group})
        self._sync_hyperparameters()
        self._lagged_norm = torch.tensor(float(state_dict.get("lagged_grad_norm", 0.0)))
        for i, p in enumerate(self._device_params):
            inner = self._inner[id(p)]
            inner.state.pop(p, None)
            name = self._names[id(p)]
            if name in same:
                inner.state[p] = _adopt(inner, p, same[name])
            elif name in converted:
                inner.state[p] = _entry_for(inner, p, converted[name], salt=i)
        if self._host is not None:
            host = self._host
            for bucket in host._buckets:
                bucket.inner.state.clear()
            for slot in host._slots:
                slot.master.copy_(slot.device.detach())
            for i, slot in enumerate(host._slots):
                name = slot.key
                if name in masters:
                    slot.master.copy_(masters[name])
                bucket = host._buckets[slot.bucket]
                if name in same:
                    bucket.inner.state[slot.master] = _adopt(bucket.inner, slot.master, same[name])
                elif name in converted:
                    bucket.inner.state[slot.master] = _entry_for(bucket.inner, slot.master, converted[name],
                                                                 salt=len(self._device_params) + i)
            host._link_state()
        self._link_state()

    def close(self) -> None:
        """Removes the hooks (step-in-backward) and stops the host part's worker."""
        _remove_hooks(self._hooks)
        if self._host is not None:
            self._host.close()


def _remove_hooks(hooks: list[Any]) -> None:
    for handle in hooks:
        handle.remove()
    hooks.clear()


def _post_hook(owner: weakref.ref[LeanAdamW]) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        self = owner()
        if self is None:
            return
        if self._arming.last and param.grad is not None:
            with torch.no_grad():
                self._step_param(param)
    return hook


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


# Optimizers whose step needs more than one parameter's gradient (or a closure): they cannot step per parameter.
_NOT_PER_PARAMETER = (torch.optim.LBFGS,)


def build_optimizer(named_parameters: Iterable[tuple[str, nn.Parameter]], *, lr: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                    state_precision: str = "fp32", offload_fraction: float = 0.0, step_in_backward: bool = False,
                    grad_scaler: torch.amp.GradScaler | None = None, world_size: int = 1,
                    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW) -> LeanAdamW:
    """The optimizer ``apply_plan``/``train`` use: AdamW with the chosen state precision, partial host offload and
    step-in-backward, as one ``torch.optim.Optimizer``.

    Args:
        named_parameters: ``model.named_parameters()``; parameters that do not require grad (frozen, e.g. under
            LoRA) are skipped.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (one group; LR schedulers change ``lr``).
        state_precision: "fp32" (8 bytes/param of moments), "bf16" (4) or "int8" (about 2; the lowbit extra).
        offload_fraction: share of the parameters (elements) whose fp32 master and state live in host RAM.
        step_in_backward: step each device parameter in backward as its gradient is final, freeing it at once.
        grad_scaler: the fp16 GradScaler in use (needed with offload_fraction > 0 or step_in_backward).
        world_size: ranks training together; step-in-backward needs 1 (DDP averages gradients after the hooks).
        optimizer_class: only AdamW is built; another class is refused with the reason.

    Raises:
        ConfigError: an unknown precision, int8 without bitsandbytes or on a device it cannot run on (naming the
            bf16 fallback), step-in-backward with an optimizer or setting that cannot do it, no trainable
            parameter, non-fp32 weights kept on the device, or a bad fraction.

    Example:
        >>> model = torch.nn.Linear(8, 4)
        >>> opt = build_optimizer(model.named_parameters(), lr=1e-3, state_precision="bf16")
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.state[model.weight]["exp_avg"].dtype
        torch.bfloat16
    """
    problems = []
    _check_precision(state_precision)
    if step_in_backward and (optimizer_class in _NOT_PER_PARAMETER
                             or not (isinstance(optimizer_class, type)
                                     and issubclass(optimizer_class, torch.optim.Optimizer))):
        raise ConfigError(
            f"step_in_backward=True with {getattr(optimizer_class, '__name__', optimizer_class)!r}: its step needs "
            "every parameter's gradient (or a closure re-evaluating the loss), so a parameter cannot step alone as "
            "its gradient is final. To resolve this error, use AdamW (build_optimizer's default) or pass "
            "step_in_backward=False.")
    if optimizer_class is not torch.optim.AdamW:
        raise ConfigError(f"build_optimizer builds AdamW (with a choice of state precision), not "
                          f"{getattr(optimizer_class, '__name__', optimizer_class)}. To resolve this error, drop "
                          "optimizer_class, or build that optimizer yourself (CPUOffloadOptimizer takes any class).")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world_size = max(world_size, torch.distributed.get_world_size())  # the ranks running now count too
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    if not named:
        raise ConfigError("build_optimizer got no parameter that requires grad. To resolve this error, pass "
                          "model.named_parameters() of a model with trainable parameters.")
    if step_in_backward and grad_scaler is not None and grad_scaler.is_enabled() and state_precision != "fp32":
        problems.append(f"step_in_backward=True with an fp16 GradScaler and state_precision={state_precision!r}: "
                        "an overflow must stop the parameters still to step on a flag read on the device, which "
                        "only fused AdamW (fp32 moments) takes. To resolve this error, pass state_precision='fp32', "
                        "bf16-mixed precision (no scaler) or step_in_backward=False.")
    if step_in_backward and world_size > 1:
        problems.append(f"step_in_backward=True with world_size={world_size}: DDP averages gradients after the "
                        "hooks that would step on them, so each rank would step on its own gradient. To resolve "
                        "this error, pass step_in_backward=False under DDP.")
    if offload_fraction and world_size > 1:
        problems.append(f"offload_fraction={offload_fraction} with world_size={world_size}: offloaded gradients "
                        "leave the device before DDP averages them. To resolve this error, pass offload_fraction=0 "
                        "(or use CPUOffloadOptimizer(offload_gradients=False) directly).")
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        problems.append(f"the parameters live on several devices ({', '.join(devices)}). To resolve this error, "
                        "move the model to one device first.")
    ConfigError.raise_if(problems)
    mask = offloaded_mask([p.numel() for _, p in named], offload_fraction)
    on_device = [n for (n, p), h in zip(named, mask, strict=True) if not h and p.dtype != torch.float32]
    if on_device:
        raise ConfigError(
            f"{len(on_device)} trainable parameters are not fp32 ({on_device[:3]}...) and would keep their AdamW "
            "state on the device without an fp32 master: updates smaller than their dtype's resolution would be "
            "lost. To resolve this error, keep trainable weights in fp32 (autocast computes in bf16), or pass "
            "offload_fraction=1.0 (the host keeps an fp32 master of bf16 weights).")
    if state_precision == "int8":
        adamw_8bit_class(named[0][1].device.type)  # raises, naming the fallback, before anything is allocated
    return LeanAdamW(named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_precision=state_precision,
                     offload_mask=mask, step_in_backward=step_in_backward, grad_scaler=grad_scaler)
