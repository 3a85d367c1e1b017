"""The lean moments: AdamW with its two moments in bf16 (stochastic rounding) or int8 (bitsandbytes), and the
conversion of a saved state between precisions.

fp32 moments hold 8 bytes per parameter; ``BF16StateAdamW`` 4 (fp32 master kept, the update in fp32, the moments
rounded back stochastically); bitsandbytes' block-wise 8-bit AdamW about 2.03 (the ``lowbit`` extra; tensors under
4,096 elements keep fp32 moments, as bitsandbytes and torchao do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from memtrain.errors import ConfigError, MemtrainError
from memtrain.message import arg
from memtrain.optim import host_kernels
from memtrain.quantize import bitsandbytes_quiet
from memtrain.techniques.optimizer import STATE_PRECISIONS

# bitsandbytes (and torchao) keep fp32 moments for tensors under this many elements: biases and norms are few
# bytes and sensitive to quantisation error.
INT8_MIN_NUMEL = 4096
INT8_BLOCK = 256  # elements per block-wise quantisation scale (one fp32 absmax per block and moment)
QMAP_BYTES = 2 * 256 * 4  # the signed and unsigned 8-bit code books, fp32, once per bitsandbytes optimizer
# Elements per call of bitsandbytes' CPU 8-bit update: it dequantises what it is given to fp32 (both moments, the
# gradient, the denominator: 16 to 20 bytes an element), so a whole 525M-element embedding would take about 10 GB of
# transient host RAM; block-aligned pieces take the same arithmetic (scales are per block) in under 100 MB.
INT8_CPU_CHUNK = 1 << 22
LOWBIT_EXTRA = "pip install 'memtrain[lowbit]'"
# Elements per pass of BF16StateAdamW's step, all the parameters of the pass together: the fp32 copies of the
# moments (8 bytes an element) live only for one pass.
BF16_CHUNK = {"cuda": 1 << 24, "cpu": 1 << 18}
INT8_DEVICES = ("cpu", "cuda")


# -- bf16 moments -------------------------------------------------------------------------------------------
_WEYL = 0x9E3779B1 - (1 << 32)  # 2**32 / golden ratio, odd, as signed int32
NOISE_OFFSETS = 1 << 16  # a segment's rounding noise starts at an offset in [0, NOISE_OFFSETS) of the noise table
_ALIGN = 16  # elements: segments start 64-byte aligned in the scratch and in their tensors (vectorised loads)
_INDEX: dict[torch.device, torch.Tensor] = {}  # the noise table per device (see noise_table)


def noise_table(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel + NOISE_OFFSETS`` int32 values of rounding noise in [0, 2**16), cached per device: entry k is
    the high 16 bits of k x a Weyl constant, mod 2**32.

    A segment of n elements reads n consecutive entries from an offset its key picks in [0, 2**16): across steps
    (a fresh key each) an element's noise runs over 2**16 consecutive terms of a Weyl sequence, whose high bits
    are uniform to within about 1e-4 of a bucket: that is what makes the rounding unbiased. Slicing the table
    costs no kernel, so the noise of a whole pass is one multi-tensor add. NOTE: relies on int32 arithmetic
    wrapping, as torch's kernels do. Grows (to a power of two, at most BF16_CHUNK + NOISE_OFFSETS) when a longer
    segment comes.
    """
    table = _INDEX.get(device)
    if table is None or table.numel() < numel + NOISE_OFFSETS:
        length = (1 << max(numel - 1, 1).bit_length()) + NOISE_OFFSETS
        h = torch.arange(length, dtype=torch.int32, device=device).mul_(_WEYL)
        table = _INDEX[device] = torch.bitwise_right_shift(h, 16).bitwise_and_(0xFFFF)
    return table


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW with both moments stored in bf16: 4 bytes per parameter instead of 8, on fp32 parameters.

    Trade-off: the update is torch's fused AdamW kernel in fp32 on fp32 copies of the moments, then the moments
    are rounded back to bf16 stochastically; against fused fp32 AdamW that is four more multi-tensor kernels per
    pass (copy in, add the rounding noise, drop the low bits, copy out) and about 3.3x its bytes moved (92 bytes
    per parameter instead of 28: 12 copying in, 28 in the kernel, 24 adding the noise, 16 masking, 12 copying
    out). Parameters must be fp32: they are the master weights. On host tensors (an offloaded optimizer's CPU step,
    training on the CPU) each tensor steps in one fused C++ pass instead (``memtrain.optim.host_kernels``): 20 bytes
    per parameter, no scratch, the same noise keys.

    On a device, one step is one pass over all the parameters of a group on a device (multi-tensor ops, no per-parameter
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
        # id(parameter) -> its rounding salt, where an owner fixes it (CPUOffloadOptimizer: the parameter's place in
        # its param_groups, so that its buckets round as one device optimizer); others take the next free salt.
        self.salts: dict[int, int] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then the moments back to bf16 (lossless): ``Optimizer.load_state_dict`` casts every floating
        state tensor to its parameter's dtype, which would keep them in fp32 (8 bytes per parameter) unnoticed. A
        state saved by torch's AdamW (fp32 moments) is rounded to nearest and gets fresh rounding counters."""
        super().load_state_dict(state_dict)
        restore_rounding_state(self, torch.bfloat16)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            for device, params in with_gradients_by_device(group, self._check).items():
                self._step_device(group, params, device, grad_scale, found_inf)
        return loss

    def _check(self, p: torch.Tensor) -> None:
        if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
            raise MemtrainError(
                f"BF16StateAdamW steps fp32 parameters (the master weights), got a {p.dtype} parameter with a "
                f"{p.grad.dtype} gradient. To resolve this error, keep trainable weights in fp32 (autocast "
                "computes in bf16), or offload the optimizer (it keeps an fp32 master of bf16 weights).")
        check_sliceable(p, "BF16StateAdamW", f", or use {arg('state_precision', 'fp32')}")
        init_rounding_state(self, p, torch.bfloat16)

    def _step_device(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)  # once per parameter, however many passes its segments fall in
        if grad_scale is not None:  # GradScaler keeps them on its device; the kernel reads them on ours
            grad_scale = grad_scale.to(device, non_blocking=True)
        if found_inf is not None:
            found_inf = found_inf.to(device, non_blocking=True)
        if all(host_kernels.runs_fused(p) for p in params):
            self._step_fused(group, params, grad_scale, found_inf)
        else:
            self._step_passes(group, params, device, grad_scale, found_inf)
        for state in states:
            state["draws"] += 1
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))  # a skipped step does not count (as torch's)

    def _step_fused(self, group: dict[str, Any], params: list[torch.Tensor], grad_scale: torch.Tensor | None,
                    found_inf: torch.Tensor | None) -> None:
        """Host tensors: one fused pass a tensor (memtrain.optim.host_kernels), the moments rounded with the noise
        of the keys the multi-tensor path gives a tensor's first segment."""
        step = host_kernels.kernels().adamw_lean_
        grad_scale, found_inf = host_kernels.as_flag(grad_scale), host_kernels.as_flag(found_inf)
        for p in params:
            state = self.state[p]
            base = (self.seed, state["salt"], state["draws"], 0)
            step(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], state["step"],
                 *host_kernels.hyperparameters(group), grad_scale, found_inf, 0,
                 noise_key(*base, 0) % NOISE_OFFSETS, noise_key(*base, 1) % NOISE_OFFSETS)

    def _step_passes(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device,
                     grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Device tensors (or no built kernel): passes of multi-tensor ops over up to ``BF16_CHUNK`` elements."""
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        chunk = BF16_CHUNK.get(device.type, 1 << 20)
        grads = [p.grad.contiguous().view(-1) for p in params]
        # The fp32 moments of one pass: [exp_avg of every segment | exp_avg_sq of every segment], each segment in
        # a slot of a multiple of _ALIGN elements so that every one starts aligned for vectorised loads.
        scratch = torch.empty(2 * min(sum(padded_numel(p.numel()) for p in params), chunk), dtype=torch.float32,
                              device=device)
        for segments in split_passes([p.numel() for p in params], chunk):
            slots = [padded_numel(end - start) for _, start, end in segments]
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
                keys_m.append(noise_key(*base, 0) % NOISE_OFFSETS)
                keys_v.append(noise_key(*base, 1) % NOISE_OFFSETS)
            torch._foreach_copy_(m32 + v32, m16 + v16)
            torch._fused_adamw_(ps, gs, m32, v32, [], seg_steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                maximize=False, grad_scale=grad_scale, found_inf=found_inf)
            table = noise_table(device, max(t.numel() for t in m32))
            noise = [table[k:k + t.numel()] for k, t in zip(keys_m + keys_v, m32 + v32, strict=True)]
            # Stochastic rounding: adding to the bit pattern carries into the kept bits with probability
            # (dropped bits) / 2**16; the mask drops the rest, so the copy back to bf16 is exact.
            torch._foreach_add_([t.view(torch.int32) for t in m32 + v32], noise)
            scratch[:2 * n].view(torch.int32).bitwise_and_(-65536)
            torch._foreach_copy_(m16 + v16, m32 + v32)


def restore_rounding_state(optimizer: Any, moments: torch.dtype) -> None:
    """After torch's ``load_state_dict`` (which casts state to each parameter's dtype): the moments back in
    ``moments``, the step counters fp32 on the device, fresh rounding counters for entries saved without them."""
    for p, state in optimizer.state.items():
        state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)
        state["exp_avg"] = state["exp_avg"].to(moments, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = state["exp_avg_sq"].to(moments, memory_format=torch.contiguous_format)
        if "salt" not in state:
            state["draws"], state["salt"] = 0, optimizer._salts
            optimizer._salts += 1
    optimizer._salts = max((s["salt"] + 1 for s in optimizer.state.values()), default=optimizer._salts)


def with_gradients_by_device(group: dict[str, Any], check: Callable[[torch.Tensor], None]
                             ) -> dict[torch.device, list[torch.Tensor]]:
    """A group's parameters that have a gradient, each checked (``check``), by device: one pass per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in group["params"]:
        if p.grad is not None:
            check(p)
            by_device.setdefault(p.device, []).append(p)
    return by_device


def check_sliceable(p: torch.Tensor, owner: str, fix: str = "") -> None:
    """MemtrainError unless ``owner``'s passes can slice ``p`` flat and run torch's fused AdamW kernel on it."""
    if not p.is_contiguous():
        raise MemtrainError(
            f"{owner} steps contiguous parameters (its passes slice them flat), got one of shape "
            f"{tuple(p.shape)} with strides {p.stride()}. To resolve this error, make the parameter contiguous "
            f"(p.data = p.data.contiguous()) before building the optimizer{fix}.")
    if p.device.type not in torch.utils._foreach_utils._get_fused_kernels_supported_devices():
        raise MemtrainError(
            f"{owner} runs torch's fused AdamW kernel, which has no {p.device.type!r} implementation. "
            f"To resolve this error, train on a CPU or CUDA device{fix}.")


def init_rounding_state(optimizer: Any, p: torch.Tensor, moments: torch.dtype) -> None:
    """``p``'s AdamW state in ``optimizer`` (BF16StateAdamW, PureBF16AdamW) at its first step: the step counter,
    both moments in ``moments``, and the rounding noise's counters (draws, and a salt: the owner's where it fixed
    one in ``optimizer.salts``, else the next free one); a loaded state's step counter moved to the device."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, dtype=moments, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=moments, memory_format=torch.contiguous_format)
        state["draws"] = 0
        state["salt"] = optimizer.salts.get(id(p), optimizer._salts)
        optimizer._salts = max(optimizer._salts, state["salt"]) + 1
    elif state["step"].device != p.device:  # e.g. loaded from a for-loop AdamW's state (CPU step counters)
        state["step"] = state["step"].to(p.device, torch.float32)


def split_passes(numels: Sequence[int], chunk: int, align: int = _ALIGN) -> list[list[tuple[int, int, int]]]:
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
            room -= padded_numel(end - start, align)
            start = end
            if room == 0:
                passes.append(segments)
                segments, room = [], chunk
    if segments:
        passes.append(segments)
    return passes


def padded_numel(numel: int, align: int = _ALIGN) -> int:
    return -(-numel // align) * align


def noise_key(*parts: int) -> int:
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
            f"{arg('state_precision', 'int8')} on a {device_type!r} device: bitsandbytes' 8-bit AdamW runs on "
            f"{' and '.join(INT8_DEVICES)} only. To resolve this error, pass {arg('state_precision', 'bf16')} (4 bytes per "
            "parameter, no extra needed) or train on a CUDA device.")
    if _ADAMW8BIT is not None:
        return _ADAMW8BIT
    try:
        with bitsandbytes_quiet():
            import bitsandbytes as bnb
    except ImportError as e:
        raise ConfigError(
            f"{arg('state_precision', 'int8')} needs bitsandbytes, which is not importable here ({e}). To resolve "
            f"this error, {LOWBIT_EXTRA}, or pass {arg('state_precision', 'bf16')} (4 bytes per parameter, no extra "
            "needed).") from None

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
        def update_step(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
            """bitsandbytes' step of one parameter; on the CPU, 8-bit moments step INT8_CPU_CHUNK elements at a
            time (bit-identical: the pieces start on block boundaries)."""
            state = self.state[p]
            if state["state1"].dtype == torch.uint8 and p.is_contiguous() and host_kernels.runs_fused(p):
                state["step"] += 1
                host_kernels.step_int8(p, state, self.get_config(gindex, pindex, group))
                return
            if p.device.type != "cpu" or state["state1"].dtype != torch.uint8 or p.numel() <= INT8_CPU_CHUNK:
                super().update_step(group, p, gindex, pindex)
                return
            config = self.get_config(gindex, pindex, group)
            state["step"] += 1
            p.data = p.data.contiguous()  # as bitsandbytes' own step (a no-op for the offloaded masters)
            grad = p.grad.contiguous().view(-1)
            weights, m, v = p.data.view(-1), state["state1"].view(-1), state["state2"].view(-1)
            for start in range(0, p.numel(), INT8_CPU_CHUNK):
                end = min(start + INT8_CPU_CHUNK, p.numel())
                blocks = slice(start // INT8_BLOCK, -(-end // INT8_BLOCK))
                bnb.functional.optimizer_update_8bit_blockwise(
                    self.optimizer_name, grad[start:end], weights[start:end], m[start:end], v[start:end],
                    config["betas"][0], config["betas"][1], 0.0, 0.0, config["eps"], state["step"], config["lr"],
                    state["qmap1"], state["qmap2"], state["absmax1"][blocks], state["absmax2"][blocks],
                    config["weight_decay"], gnorm_scale=1.0, skip_zeros=config["skip_zeros"])

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


def state_class(precision: str, device_type: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class holding moments of ``precision`` on ``device_type``, and its implementation kwargs."""
    if precision == "fp32":
        return torch.optim.AdamW, ({"fused": True} if device_type in ("cpu", "cuda") else {"foreach": False})
    if precision == "bf16":
        return BF16StateAdamW, {}
    return adamw_8bit_class(device_type), {}


def check_precision(state_precision: object) -> None:
    if state_precision not in STATE_PRECISIONS:
        raise ConfigError(f"{arg('state_precision', state_precision)} is not one of {list(STATE_PRECISIONS)}. To resolve "
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


def adopt_entry(inner: torch.optim.Optimizer, p: torch.Tensor, entry: dict[str, Any]) -> dict[str, Any]:
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


def entry_for(inner: torch.optim.Optimizer, p: torch.Tensor, moments: tuple[float, torch.Tensor, torch.Tensor],
               salt: int) -> dict[str, Any]:
    """A state entry in ``inner``'s own format for parameter ``p`` holding ``moments`` (requantised if 8-bit)."""
    step, m, v = moments
    m, v = m.to(p.device, torch.float32).view(p.shape), v.to(p.device, torch.float32).view(p.shape)
    if isinstance(inner, torch.optim.AdamW):
        fused = bool(inner.defaults.get("fused")) or bool(inner.defaults.get("capturable"))
        step_t = torch.tensor(step, dtype=torch.float32, device=p.device if fused else "cpu")
        return {"step": step_t, "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    if hasattr(inner, "entry_for"):  # PureBF16AdamW: its moments' own precision
        return inner.entry_for(p, moments, salt)
    if isinstance(inner, BF16StateAdamW):
        fused = p.device.type in ("cpu", "cuda")
        step_t = torch.tensor(step, dtype=torch.float32, device=p.device if fused else "cpu")
        return {"step": step_t, "exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16(), "draws": 0, "salt": salt}
    # bitsandbytes: its init_state gives the layout (8-bit codes or fp32 by size), then the moments fill it.
    import bitsandbytes.functional as bnbf  # lazy: the optional lowbit extra

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

