"""Mixed precision: run the forward in 16-bit under autocast, keep fp32 weights, optimizer state and loss.

bf16 halves most activation bytes at no accuracy cost worth measuring and needs no loss scaling (it has fp32's
exponent range); fp16 halves them too but its small range makes small gradients underflow, so it needs a
GradScaler, whose skipped steps ``GradientAccumulator`` counts. fp32 is exact and, on a CPU, usually the fastest.

The choice is never switched silently: an unknown mode or a mode the device cannot run raises ``ConfigError``;
``resolve_precision`` returns its choice together with the reason, for the log.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from memtrain.device import accelerator
from memtrain.errors import ConfigError
from memtrain.message import arg

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

_AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _device_type(device: torch.device | str) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"{arg('device', device)} is not a torch device ({e}). To resolve this error, pass e.g. "
                          "'cuda', 'cuda:1' or 'cpu'.") from None


@dataclass(frozen=True)
class MixedPrecision:
    """Autocast for one device type plus, for fp16 only, a GradScaler.

    Trades precision of the forward's matmuls for memory and speed: about half the activation bytes in 16-bit,
    weights and optimizer state stay fp32. The loop needs no ``if`` per mode: ``autocast()`` is a
    ``nullcontext()`` in fp32 and ``scaler`` is None unless fp16.

    Args:
        mode: "fp32", "bf16-mixed" or "fp16-mixed".
        device_type: the device type the model runs on ("cuda", "cpu", ...).

    Raises:
        ConfigError: unknown mode or device type, or autocast unavailable for the device type.

    Example:
        >>> mp = MixedPrecision("bf16-mixed", "cpu")
        >>> with mp.autocast():
        ...     y = torch.ones(2, 2) @ torch.ones(2, 2)
        >>> y.dtype, mp.scaler
        (torch.bfloat16, None)
    """

    mode: Precision
    device_type: str = "cuda"
    # A fresh GradScaler per MixedPrecision (its scale is per-run state); None unless fp16.
    scaler: torch.amp.GradScaler | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in PRECISIONS:
            problems.append(f"{arg('precision', self.mode)} is not one of {', '.join(PRECISIONS)}. To resolve this "
                            f"error, pass {arg('precision', 'fp32')}, 'bf16-mixed' or 'fp16-mixed'.")
        if not isinstance(self.device_type, str) or ":" in self.device_type:
            problems.append(f"device_type={self.device_type!r} must be a device type such as 'cuda' or 'cpu' "
                            "(no index). To resolve this error, pass torch.device(d).type.")
        elif self.mode != "fp32" and not torch.amp.autocast_mode.is_autocast_available(self.device_type):
            problems.append(f"{arg('precision', self.mode)}: torch has no autocast for device type "
                            f"{self.device_type!r}. To resolve this error, pass {arg('precision', 'fp32')}.")
        elif self.mode != "fp32" and self.device_type == "cuda" and not torch.cuda.is_available():
            # torch would only warn and run autocast and the scaler disabled: a silent switch to fp32.
            problems.append(f"{arg('precision', self.mode)} on device type 'cuda', but torch sees no CUDA device. To "
                            "resolve this error, train on the CPU (device_type='cpu') or install a CUDA build.")
        ConfigError.raise_if(problems)
        if self.mode == "fp16-mixed":
            object.__setattr__(self, "scaler", torch.amp.GradScaler(self.device_type))

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of autocast regions (fp32 when autocast is off)."""
        return _AUTOCAST_DTYPES.get(self.mode, torch.float32)

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The context to run forward (and the loss) in; backward needs none."""
        if self.mode == "fp32":
            return contextlib.nullcontext()
        # No weight-cast cache: it would keep a 16-bit copy of every fp32 weight until forward ends, which under
        # checkpointing (and FSDP2's gathered blocks) is half the weights' bytes kept for nothing; each matmul
        # casts its weight instead, once per use, as a cache miss would (and a recompute does anyway).
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)


def resolve_precision(device: torch.device | str, requested: Precision | Literal["auto"] = "auto", *,
                      because: str = "requested") -> tuple[Precision, str]:
    """Picks the precision for ``device`` and says why, nanochat-style ("bf16-mixed, because: ...").

    "auto" picks bf16-mixed on CUDA devices with native bf16 (SM 8.0+, or ROCm with bf16) and on a simulated device
    (``MEMTRAIN_SIMULATED_DEVICE``: it stands for such a GPU), fp16-mixed on older CUDA devices (fp16 tensor cores,
    with loss scaling), fp32 on a CPU and on other devices. An explicit request
    is checked and returned unchanged: it is never replaced by another precision.

    Args:
        device: the device the model trains on.
        requested: "auto" or an explicit precision.
        because: why an explicit ``requested`` was asked for, for the reason ("requested": the user asked; a
            caller that implies a precision says what implies it).

    Returns:
        (precision, reason), the reason ready to print.

    Raises:
        ConfigError: an unknown precision, or one the device cannot run.

    Example:
        >>> resolve_precision("cpu")[0]
        'fp32'
    """
    device_type = _device_type(device)
    simulated = device_type == "cpu" and accelerator(device).kind == "simulated"
    if requested != "auto":
        MixedPrecision(requested, device_type)  # raises on an unknown mode or a device without autocast
        hint = ""
        if device_type == "cuda" and requested == "bf16-mixed" and not _cuda_native_bf16(device):
            hint = f" (Hint: {_cuda_name(device)} has no native bf16, it is emulated and slow; fp16-mixed is faster)"
        if device_type == "cpu" and requested != "fp32" and not simulated:
            hint = " (Hint: 16-bit autocast on a CPU saves activation memory but is usually slower than fp32)"
        return requested, f"{requested}, because: {because}{hint}"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{arg('device', str(device))} is CUDA but torch sees no CUDA device. To resolve this "
                              f"error, pass {arg('device', 'cpu')} or install a CUDA build of torch.")
        if _cuda_native_bf16(device):
            return "bf16-mixed", f"bf16-mixed, because: {_cuda_name(device)} supports bf16"
        return "fp16-mixed", (f"fp16-mixed, because: {_cuda_name(device)} has no native bf16 (needs SM 8.0+), "
                              "fp16 has tensor cores (loss scaling on)")
    if simulated:
        return "bf16-mixed", ("bf16-mixed, because: the simulated device (MEMTRAIN_SIMULATED_DEVICE) stands for a GPU "
                              "with bf16 (the CPU's autocast computes it)")
    if device_type == "cpu":
        # NOTE: CPU autocast runs bf16 and fp16 too (the tests use it), but without AMX its kernels are usually
        # slower than fp32 and it rounds the matmuls; on a CPU, RAM is rarely the limit this library serves.
        capability = torch.backends.cpu.get_cpu_capability()
        return "fp32", (f"fp32, because: CPU ({capability}): 16-bit autocast on a CPU is usually slower than fp32 "
                        "and rounds the matmuls; pass --precision bf16-mixed to trade speed for memory")
    return "fp32", (f"fp32, because: memtrain has no verified 16-bit default for device type {device_type!r}; "
                    "pass --precision bf16-mixed or fp16-mixed to choose one")


def _cuda_native_bf16(device: torch.device | str) -> bool:
    if torch.version.hip:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability(device)[0] >= 8


def _cuda_name(device: torch.device | str) -> str:
    if torch.version.hip:
        return f"ROCm {torch.cuda.get_device_name(device)}"
    major, minor = torch.cuda.get_device_capability(device)
    return f"CUDA SM {major}.{minor}"


def step_with_inf_flag(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None,
                       grad_scale: torch.Tensor | None = None) -> None:
    """``optimizer.step()`` handed ``found_inf`` (and ``grad_scale``) as ``GradScaler.step`` hands them to an
    optimizer that takes them (torch's fused Adam/AdamW, BF16StateAdamW): where the flag is set on the device the
    step leaves weights, moments and step count as they were, with no host sync. ``found_inf=None``: a plain
    step. The caller checks that the optimizer takes the flag."""
    if found_inf is None:
        optimizer.step()
        return
    device = next((p.device for group in optimizer.param_groups for p in group["params"]), found_inf.device)
    if found_inf.device != device:  # FSDP2's host offload: the step runs where the shards are, on the host
        found_inf = found_inf.to(device)
        grad_scale = grad_scale.to(device) if grad_scale is not None else None
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = optimizer.found_inf = None
