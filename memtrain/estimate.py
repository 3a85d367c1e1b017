"""Predict the peak memory of a training step without running it: no GPU, no real activations.

The model's forward and backward run on tensors without data (meta tensors for a CUDA target; fake CPU tensors,
``torch._subclasses.FakeTensorMode``, for a CPU target), so a 70B Llama config costs seconds and no memory. Two
things are counted along the way:

- the tensors autograd saves for backward, by the same ``MemoryMeter`` that ``measure`` uses, so on the CPU the
  figure equals ``measure``'s exactly;
- every tensor alive at every moment (a dispatch mode sees each allocation, a weak reference each free), which
  gives the peak of the step and the tensors that make it, as the device allocator would see them.

For ``device="cuda"`` the simulation runs with the CPU's kernels but CUDA's rules where they change memory: the
CUDA autocast op lists (e.g. ``pow`` and ``layer_norm`` run in fp32), the CUDA attention kernel that
``scaled_dot_product_attention`` picks (flash, memory-efficient or the math fallback that materialises the
attention matrix), and the caching allocator's 512-byte rounding. Optimizer state and step temporaries are added
by formula for the optimizer named.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
import numbers
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from memtrain.checkpointing import (
    Checkpointing,
    _auto_blocks,
    _CheckpointedForward,
    apply_checkpointing,
    remove_checkpointing,
)
from memtrain.errors import ConfigError, MemtrainError, describe_exception
from memtrain.loss import (
    HF_MODEL_TYPES,
    apply_chunked_loss,
    chunk_tokens_of,
    output_head,
    remove_chunked_loss,
    supports_chunked_loss,
)
from memtrain.measure import MemoryMeter, _as_loss, _storage_key
from memtrain.offload import MIN_BYTES_DEFAULT, ActivationOffloader, _derived_from_leaf, _find_head
from memtrain.report import MemoryReport, format_bytes

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]
OptimizerKind = Literal["adamw", "sgd", "sgd-momentum", "adafactor", "adamw-offload"]

_AUTOCAST_DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
# The CUDA caching allocator hands out blocks in multiples of 512 bytes; memory_allocated counts blocks.
_CUDA_BLOCK = 512
# cuBLAS keeps one workspace per (handle, stream); forward (main thread) and backward (autograd's device thread)
# use different handles. 32 MiB each on Hopper (torch's default for sm90), allocated by the caching allocator.
_CUDA_WORKSPACE_BYTES = 2 * 32 * 2**20


# -- arguments ----------------------------------------------------------------------------------------------
def _checkpointing_kwargs(checkpointing: Any, problems: list[str]) -> Checkpointing | dict[str, Any] | None:
    """A ``Checkpointing`` for every spelling it parses, or a mapping of ``apply_checkpointing`` arguments as
    given; None (with the problem noted) for anything else."""
    if isinstance(checkpointing, Mapping):
        allowed = [n for n in inspect.signature(apply_checkpointing).parameters if n != "model"]
        unknown = [k for k in checkpointing if k not in allowed]
        if unknown:
            problems.append(f"checkpointing: unknown apply_checkpointing arguments {unknown}. To resolve this "
                            f"error, use only {allowed}.")
            return None
        return dict(checkpointing)
    try:
        return Checkpointing.parse(checkpointing)
    except ConfigError as e:
        problems.append(f"{e} (or a dict of apply_checkpointing arguments such as {{'every': 2}})")
        return None


def _check_choice(name: str, value: Any, allowed: tuple[str, ...], problems: list[str]) -> None:
    if value not in allowed:
        problems.append(f"{name}={value!r} is not known. To resolve this error, pass one of {list(allowed)}.")


def hf_config_from_file(path: str | os.PathLike[str]) -> Any:
    """Reads a Hugging Face ``config.json`` (plain JSON, nothing executed) into its ``PretrainedConfig``.

    Raises:
        ConfigError: the file is missing, is not JSON, has no ``model_type``, or names a type transformers lacks.
    """
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("reading a Hugging Face config needs transformers. To resolve this error, "
                          "pip install 'memtrain[hf]'.") from None
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"could not read the Hugging Face config {str(path)!r}: {e}. To resolve this error, pass "
                          "the path of a config.json file.") from None
    model_type = fields.pop("model_type", None) if isinstance(fields, dict) else None
    if not model_type:
        raise ConfigError(f"{str(path)!r} has no \"model_type\" field, so its model class is unknown. To resolve "
                          "this error, add e.g. \"model_type\": \"llama\" to the file.")
    try:
        from transformers import CONFIG_MAPPING

        known = model_type in CONFIG_MAPPING
    except ImportError:
        known = True
    if not known:
        raise ConfigError(f"{str(path)!r}: transformers does not know model_type={model_type!r}. To resolve this "
                          "error, upgrade transformers or fix the model_type.")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 - transformers validates fields with exceptions of many types
        raise ConfigError(f"{str(path)!r}: a field of this {model_type} config is invalid "
                          f"({describe_exception(e)}). To resolve "
                          "this error, fix that field in the file.") from None


# -- the model, as fake tensors -----------------------------------------------------------------------------
def _meta_model(model: Any) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no data copied)."""
    try:
        from transformers import PretrainedConfig
    except ImportError:  # transformers is optional
        PretrainedConfig = ()  # noqa: N806
    if PretrainedConfig and isinstance(model, PretrainedConfig):
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(copy.deepcopy(model))
        except Exception as e:  # noqa: BLE001 - re-raised with the fix
            raise ConfigError(
                f"estimate: could not build a causal LM from {type(model).__name__} ({type(e).__name__}: {e}). "
                "To resolve this error, pass a config AutoModelForCausalLM knows, or build the model yourself under "
                "`with torch.device('meta'):` and pass the module."
            ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"estimate: model is a {type(model).__name__}, not an nn.Module or a Hugging Face config. "
            "To resolve this error, pass the module (any device, meta included) or its PretrainedConfig."
        )
    # The memo makes deepcopy reuse meta stand-ins for parameters and buffers: no data is copied, ties survive.
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _to_fake(model: nn.Module, fake_mode: FakeTensorMode) -> None:
    """Replaces every parameter and buffer by a fake CPU tensor of the same shape, in place (ties kept)."""
    done: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            with fake_mode:
                data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            done[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        return done[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b)


# -- the batch ----------------------------------------------------------------------------------------------
def _shape_of(x: Any) -> tuple[tuple[Any, ...], torch.dtype] | None:
    """(shape, dtype) of a tensor or of a shape given as numbers (checked by ``_bad_dimensions``), else None."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, torch.Size) or (isinstance(x, (tuple, list)) and x and all(isinstance(d, numbers.Number)
                                                                                 for d in x)):
        return tuple(x), torch.long
    return None


def _is_count(value: Any) -> bool:
    """An integer >= 1 (not a bool, not a float that happens to be whole)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _bad_dimensions(where: str, shape: tuple[Any, ...], problems: list[str]) -> None:
    """One problem naming each dimension of ``shape`` that is not an integer >= 1 (a traced batch needs sizes)."""
    bad = [f"dimension {i} is {d!r}" for i, d in enumerate(shape) if not _is_count(d)]
    if bad:
        problems.append(f"{where} of shape {tuple(shape)}: {', '.join(bad)}; every dimension of a batch must be an integer "
                        ">= 1. To resolve this error, pass sizes such as batch=(4, 2048) (micro-batch, tokens).")


def _batch_spec(batch: Any, micro_batch_size: int | None, seq_len: int | None,
                problems: list[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
    """Named input shapes: ``{"input_ids": ((B, T), long)}`` for tokens, or a dict's entries."""
    bad = [f"{name}={value!r}" for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len))
           if value is not None and not _is_count(value)]
    if bad:
        problems.append(f"{' and '.join(bad)}: each must be an integer >= 1. To resolve this error, pass e.g. "
                        "micro_batch_size=4, seq_len=2048.")
        return None
    if batch is None:
        if micro_batch_size is None or seq_len is None:
            problems.append("estimate needs a batch: none was given, and micro_batch_size and seq_len are not both "
                            "set. To resolve this error, pass batch=(B, T), a token tensor, or both of them.")
            return None
        spec = {"input_ids": ((micro_batch_size, seq_len), torch.long)}
    elif isinstance(batch, Mapping):
        spec = {}
        for key, value in batch.items():
            shape = _shape_of(value)
            if shape is None:
                problems.append(f"batch[{key!r}] is a {type(value).__name__}, not a tensor or a shape. To resolve "
                                "this error, pass tensors (any device, meta included) or shapes as tuples.")
                return None
            spec[key] = shape
    else:
        shape = _shape_of(batch)
        if shape is None:
            problems.append(f"batch is a {type(batch).__name__}, not a tensor, a shape or a dict of them. To resolve "
                            "this error, pass e.g. batch=(4, 2048) or the input tensor.")
            return None
        spec = {"input_ids": shape}
    resized = {}
    for key, (shape, dtype) in spec.items():
        dims = list(shape)
        if micro_batch_size is not None and dims:
            dims[0] = micro_batch_size
        if seq_len is not None and len(dims) >= 2 and not dtype.is_floating_point:
            dims[1] = seq_len
        _bad_dimensions("batch" if batch is None or not isinstance(batch, Mapping) else f"batch[{key!r}]",
                        tuple(dims), problems)
        resized[key] = (tuple(int(d) if _is_count(d) else d for d in dims), dtype)  # numpy ints as ints
    return resized


def _max_positions(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "seq_len"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def _call_convention(model: nn.Module, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                     explicit_dict: bool) -> Callable[[dict[str, torch.Tensor]], Any]:
    """How to run a training forward: HF ``model(input_ids=, labels=)``, memtrain ``GPT(idx, targets)``, or
    ``model(x)``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if explicit_dict:
        add_labels = "labels" in params and "labels" not in spec and "input_ids" in spec
        return lambda t: model(**t, **({"labels": t["input_ids"].clone()} if add_labels else {}))
    if "labels" in params and "input_ids" in params:
        return lambda t: model(input_ids=t["input_ids"], labels=t["input_ids"].clone())
    if "targets" in params:
        return lambda t: model(t["input_ids"], t["input_ids"].clone())
    return lambda t: model(t["input_ids"])


# -- optimizer state ----------------------------------------------------------------------------------------
def _optimizer_bytes(params: Sequence[nn.Parameter], kind: str, round_to: int,
                     on_cuda: bool) -> tuple[int, int, int, str]:
    """(device state bytes, device step-temporary bytes, host bytes, assumption) for ``kind``."""

    def r(n: int) -> int:
        return _round(n, round_to)

    sizes = [p.numel() * p.element_size() for p in params]
    # Fused/capturable AdamW keeps its step counter as a 4-byte tensor on the device, one per parameter.
    step_bytes = len(params) * r(4) if on_cuda else 0
    if kind == "adamw":
        return (2 * sum(r(n) for n in sizes) + step_bytes, 0, 0,
                "AdamW fused (torch.optim.AdamW(fused=True)): exp_avg and exp_avg_sq in the parameter dtype, no "
                "step temporaries; the foreach implementation would add one fp32 copy of the parameters")
    if kind == "sgd":
        return 0, 0, 0, "SGD without momentum: no optimizer state"
    if kind == "sgd-momentum":
        return sum(r(n) for n in sizes), 0, 0, "SGD with momentum: one buffer per parameter, weight_decay=0"
    if kind == "adafactor":
        state = 0
        for p in params:
            shape = tuple(p.shape)
            if len(shape) >= 2:  # factored second moment: a row and a column vector
                state += r(math.prod(shape[:-1]) * 4) + r(math.prod(shape[:-2] + shape[-1:]) * 4)
            else:
                state += r(p.numel() * 4)
        temp = sum(r(p.numel() * 4) for p in params)
        return (state + step_bytes, temp, 0,
                "Adafactor (torch.optim.Adafactor, foreach): factored second moments, no first moment; the step "
                "builds one fp32 variance estimate per parameter at once")
    # adamw-offload is memtrain.optim.optimizer_memory(offload_fraction=1.0)'s: one byte model for both.
    raise AssertionError(f"_optimizer_bytes: {kind!r} is counted by memtrain.optim.optimizer_memory")


def _storage_elements(t: torch.Tensor) -> int:
    """Elements a fresh tensor of this shape and strides needs."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _round(n: int, to: int) -> int:
    return -(-n // to) * to if to > 1 and n > 0 else n


# -- live memory ------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """A stretch of the traced step spent in one place: a block's forward, a block's backward (its recompute
    included), or the model's own code around the blocks (embeddings before them, the head and loss after).

    The planner composes candidate plans from these: bytes alive when the run began and at its most, bytes it
    saved for backward, and the work it did (for the time model).
    """

    phase: str  # "forward" or "backward"
    label: str  # a block's qualified name, or the model's class name outside the blocks
    start_bytes: int  # bytes alive (as the allocator counts them) when the run began
    peak_bytes: int  # the most bytes alive during the run
    end_bytes: int = 0  # bytes alive when the next run began (or the phase ended)
    saved_bytes: int = 0  # bytes saved for backward during the run, each storage once
    matmul_flops: float = 0.0  # mm / bmm / addmm / convolution
    attention_flops: float = 0.0  # fused attention kernels (the math kernel's bmm count as matmul_flops)
    other_bytes: int = 0  # bytes read and written by every other op that computes (memory-bound work)
    ops: int = 0  # operator calls (per-op launch and dispatch overhead)
    offloaded_bytes: int = 0  # bytes the activation offloader moved to the host during the run
    # Each storage it moved, in bytes, in the order moved: the planner applies the offloader's threshold to these
    # at any micro-batch (a storage under it at the traced sizes can be over it at a larger one).
    offloaded_sizes: list[int] = field(default_factory=list, repr=False)
    released_bytes: int = 0  # bytes allocated here that autocast's weight-cast cache let go when forward ended
    gradient_bytes: int = 0  # parameter gradients that came into being during the run (backward)
    gradient_bytes_at_peak: int = 0  # of those, the ones already alive at the run's peak
    peak_serial: int = field(default=0, repr=False)  # the allocation counter at the peak
    # Bytes alive after every allocation and free of the run, and the allocation counter then: two traces of one
    # step at two micro-batch sizes pair point by point (the planner's exact peaks at any micro-batch).
    curve: list[int] = field(default_factory=list, repr=False)
    serials: list[int] = field(default_factory=list, repr=False)
    gradients: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (landing serial, bytes)


_MATMUL_OPS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}  # name -> index of the first matrix argument
_ATTENTION_OPS = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
})
# Views, metadata and allocation-only ops: no arithmetic, no memory traffic worth counting.
_FREE_OPS = frozenset({"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
                       "squeeze", "slice", "select", "alias", "as_strided", "detach", "empty", "empty_like",
                       "empty_strided", "new_empty", "new_empty_strided", "split", "split_with_sizes", "unbind",
                       "lift_fresh", "_reshape_alias", "unflatten", "flatten", "chunk", "narrow"})


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _attention_flops(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> float:
    """FLOPs of one attention forward: QK^T and PV, halved when causal (the kernels skip the masked half)."""
    b, h, tq, d = q.shape[-4:] if q.dim() >= 4 else (1, *q.shape[-3:])
    return 4.0 * b * h * tq * k.shape[-2] * d * (0.5 if is_causal else 1.0)


def _argument(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], name: str, default: Any = None) -> Any:
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


def _op_cost(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> tuple[float, float, int]:
    """(matmul FLOPs, attention FLOPs, memory bytes) of one aten call."""
    name = func.overloadpacket.__name__
    if name in _MATMUL_OPS:
        a, b = args[_MATMUL_OPS[name]], args[_MATMUL_OPS[name] + 1]
        return 2.0 * _numel(a.shape) * b.shape[-1], 0.0, 0
    if name in ("convolution", "convolution_backward"):
        # weight: (out channels, in channels / groups, *kernel); every output element costs 2 x that many FLOPs.
        weight = args[1] if name == "convolution" else args[2]
        outputs = out if name == "convolution" else args[0]  # the backward's grad_output has the output's shape
        flops = 2.0 * _numel(outputs.shape) * _numel(weight.shape[1:])
        return (2.0 * flops if name == "convolution_backward" else flops), 0.0, 0  # input grad + weight grad
    if name.startswith("_linear_cross_entropy_batch_chunked"):
        # torch's chunked linear + cross-entropy: the logits (2NHV) and, computed in forward, their gradients with
        # respect to the input and the weight (2NHV each); backward only scales what forward kept.
        hidden, weight = args[0], args[1]
        logits = _numel(hidden.shape[:-1]) * weight.shape[0]
        # About 20 bytes of traffic a logit inside: fp32 logits written, the softmax read and written, its
        # gradient read and written, chunk by chunk.
        return 6.0 * _numel(hidden.shape) * weight.shape[0], 0.0, 20 * logits
    if name in _ATTENTION_OPS:
        causal = bool(_argument(func, args, kwargs, "is_causal", False))
        return 0.0, _attention_flops(args[0], args[1], causal), 0
    if "attention" in name and name.endswith("backward"):
        query, key = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
            causal = bool(_argument(func, args, kwargs, "is_causal", False))
            return 0.0, 2.5 * _attention_flops(query, key, causal), 0  # five matmuls against the forward's two
    if name in _FREE_OPS:
        return 0.0, 0.0, 0
    return 0.0, 0.0, _tensor_bytes(args) + _tensor_bytes(out if isinstance(out, (list, tuple)) else (out,))


_SCALARS = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _replay_key(x: Any) -> Any:
    """What identifies an op argument for replay (None: it cannot be replayed)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta":
            return None
        return (tuple(x.shape), x.stride(), x.dtype, x.storage_offset())
    if x is None or isinstance(x, _SCALARS):
        return (type(x), x)
    if isinstance(x, (list, tuple)):
        parts = tuple(_replay_key(y) for y in x)
        return None if any(p is None for p in parts) else (type(x), parts)
    return None


def _tensor_bytes(values: Any) -> int:
    """Bytes of the tensors among ``values`` (one level of lists and tuples)."""
    total = 0
    for x in values:
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, (list, tuple)):
            total += sum(y.numel() * y.element_size() for y in x if isinstance(y, torch.Tensor))
    return total


class _LiveTracker(TorchDispatchMode):
    """Counts the bytes of every storage alive, as an allocator would: one allocation per op output that does not
    alias an input, freed when the last tensor using it dies."""

    def __init__(self, round_to: int, where: Callable[[], str]):
        super().__init__()
        self.round_to = round_to
        self.where = where
        self.phase = "forward"
        # storage key -> (bytes, label, serial). Keys (StorageImpl addresses) are reused after a free; serials
        # are not, so categories are kept by serial.
        self.live: dict[int, tuple[int, tuple[Any, ...], int]] = {}
        self.saved_serials: set[int] = set()
        self._serial = 0
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.peak_at: tuple[str, str] = ("", "")
        self.peak_live: dict[int, tuple[int, tuple[Any, ...], int]] = {}
        self._pending = False  # a new peak whose live set is not copied yet
        self.cuda_workspaces = round_to > 1
        self.replay: dict[tuple[Any, ...], Any] | None = None  # set to {} to replay meta outputs
        self.runs: list[Run] = []  # forward and backward, in order (see Run)
        self._mutable: dict[Any, bool] = {}  # op -> mutates or aliases (never replayed)
        self.recording = False  # runs are recorded between start_runs() and stop_runs()

    def add(self, t: torch.Tensor, label: tuple[Any, ...]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        nbytes = _round(storage.nbytes(), self.round_to)
        self._serial += 1
        self.live[key] = (nbytes, label, self._serial)
        self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
        self.add_bytes(nbytes)

    def mark_saved(self, t: torch.Tensor) -> None:
        entry = self.live.get(t.untyped_storage()._cdata)
        if entry is not None:
            self.saved_serials.add(entry[2])

    def add_bytes(self, nbytes: int) -> None:
        self.current += nbytes
        if self.recording and self.runs:
            run = self.runs[-1]
            run.curve.append(self.current)
            run.serials.append(self._serial)
            if self.current > run.peak_bytes:
                run.peak_bytes = self.current
                run.peak_serial = self._serial
        if self.current > self.peak:
            self.peak = self.current
            self.peak_at = (self.phase, self.where())
            self._pending = True

    def run_here(self) -> Run | None:
        """The run now in progress, a new one when the place (phase, block) changed since the last op."""
        if not self.recording:
            return None
        label = self.where()
        last = self.runs[-1] if self.runs else None
        if last is None or last.phase != self.phase or last.label != label:
            if last is not None:
                last.end_bytes = self.current
            last = Run(self.phase, label, self.current, self.current, curve=[self.current], serials=[self._serial])
            self.runs.append(last)
        return last

    def end_runs(self) -> None:
        """Closes the run in progress (at a phase boundary: the next phase starts a new one)."""
        if self.runs:
            self.runs[-1].end_bytes = self.current
        self.runs.append(Run("-", "-", self.current, self.current))  # a boundary marker, removed at the end

    def add_attention_flops(self, flops: float) -> None:
        """Work of an attention kernel the CUDA rules emulate without aten ops (see _FusedAttention)."""
        run = self.run_here()
        if run is not None:
            run.attention_flops += flops

    def _free(self, key: int, _ref: weakref.ref) -> None:
        # Live bytes only grow between frees, so the moment before a free is where a peak is complete.
        self.snapshot()
        entry = self.live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            if self.recording and self.runs:
                self.runs[-1].curve.append(self.current)
                self.runs[-1].serials.append(self._serial)

    def snapshot(self) -> None:
        if self._pending:
            self.peak_live = dict(self.live)
            self._pending = False

    def transient(self, nbytes: int, label: tuple[Any, ...]) -> None:
        """An allocation a kernel makes and frees inside itself (a workspace the fake op does not show)."""
        self._serial += 1
        key = -self._serial
        self.live[key] = (_round(nbytes, self.round_to), label, self._serial)
        self.add_bytes(self.live[key][0])
        self._free(key, None)  # type: ignore[arg-type]

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Runs ``func``; on meta tensors, replays the output metadata of an identical earlier call instead.

        Identical blocks repeat identical calls, and torch's meta functions are mostly Python: replaying what a
        call produced (shape, strides, dtype) makes a 70B model's 80 layers cost little more than one.
        """
        if self.replay is None:
            return func(*args, **kwargs)
        mutable = self._mutable.get(func)
        if mutable is None:
            mutable = self._mutable[func] = func._schema.is_mutable or any(
                r.alias_info is not None for r in func._schema.returns)
        if mutable:
            return func(*args, **kwargs)
        key_parts: list[Any] = [func, len(args), tuple(kwargs)]
        for x in (*args, *kwargs.values()):
            part = _replay_key(x)
            if part is None:
                return func(*args, **kwargs)
            key_parts.append(part)
        key = tuple(key_parts)
        recipe = self.replay.get(key)
        if recipe is not None:
            single, metas = recipe
            outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in metas]
            return outs[0] if single else tuple(outs)
        out = func(*args, **kwargs)
        single = isinstance(out, torch.Tensor)
        if not single and not (isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)):
            return out
        metas = []
        for t in (out,) if single else out:
            # Only fresh, exactly-sized outputs can be replayed by empty_strided.
            if t.storage_offset() != 0 or t.untyped_storage().nbytes() != _storage_elements(t) * t.element_size():
                return out
            metas.append((tuple(t.shape), t.stride(), t.dtype))
        self.replay[key] = (single, metas)
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        run = self.run_here()
        out = self._run(func, args, kwargs or {})
        if run is not None:
            matmul, attention, nbytes = _op_cost(func, args, kwargs or {}, out)
            run.matmul_flops += matmul
            run.attention_flops += attention
            run.other_bytes += nbytes
            run.ops += 1
        if self.cuda_workspaces and func is torch.ops.aten.embedding_dense_backward.default:
            # CUDA sorts the indices and reduces per partial segment: up to one fp32 row per token, plus index
            # buffers (an upper bound; few repeated tokens is the common case).
            tokens, dim = args[1].numel(), args[0].shape[-1]
            self.transient(tokens * dim * 4 + 4 * tokens * 8,
                           (self.phase, self.where(), "embedding backward workspace", (tokens, dim), torch.float32))
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(outs):
            # Views and in-place results alias an input: no new memory (fake tensors may still give them a storage).
            aliased = i < len(returns) and returns[i].alias_info is not None
            if isinstance(t, torch.Tensor) and not aliased:
                self.add(t, (self.phase, self.where(), func.overloadpacket.__name__, tuple(t.shape), t.dtype))
            elif isinstance(t, (list, tuple)) and not aliased:  # foreach ops return lists
                for u in t:
                    if isinstance(u, torch.Tensor):
                        self.add(u, (self.phase, self.where(), func.overloadpacket.__name__, tuple(u.shape), u.dtype))
        return out


# -- CUDA rules on the CPU's kernels -------------------------------------------------------------------------
# torch's CUDA autocast policy (aten/src/ATen/autocast_mode.cpp), by Python function name.
_LOWER_PRECISION = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
})
_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "cross_entropy",
    "rms_norm",
})
# Ops whose output dtype autocast sets to fp32 (when the caller gave none): fp32 output from a bf16 input.
_FP32_OUTPUT = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum", "linalg_vector_norm"})
_LOW = (torch.float16, torch.bfloat16)


class _CudaRules(TorchFunctionMode):
    """CUDA autocast (when ``dtype`` is set) and CUDA's choice of attention kernel, on the CPU's kernels."""

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype = dtype
        self.autocast = False  # on during forward and during a checkpointed block's recompute (grad enabled)
        self.cache: dict[int, torch.Tensor] | None = None  # autocast's cast cache: leaf weights, until forward ends
        self.tracker: _LiveTracker | None = None  # told the work of the attention kernels emulated here

    def around_recompute(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wraps a checkpointed block's function so that its recompute in backward runs under these rules too.

        ``loss.backward()`` goes through this mode's ``__torch_function__``, which takes the mode off the stack while
        it runs, so the recompute would otherwise see the CPU's rules (and fail checkpoint's dtype check).
        """

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if self in torch.overrides._get_current_function_mode_stack():
                return fn(*args, **kwargs)
            with self:
                return fn(*args, **kwargs)

        return run

    def _cast(self, x: Any, dtype: torch.dtype, cacheable: bool) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
                and x.dtype != dtype):
            return x
        if cacheable and self.cache is not None and x.is_leaf and x.requires_grad and x.dtype == torch.float32:
            cached = self.cache.get(id(x))
            if cached is None:
                cached = self.cache[id(x)] = x.to(dtype)
            return cached
        return x.to(dtype)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if self.dtype is not None and self.autocast and torch.is_grad_enabled():
            if name in _LOWER_PRECISION:
                args, kwargs = tree_map(lambda x: self._cast(x, self.dtype, True), (args, kwargs))
            elif name in _FP32:
                args, kwargs = tree_map(lambda x: self._cast(x, torch.float32, False), (args, kwargs))
            elif name in _FP32_OUTPUT and kwargs.get("dtype") is None and any(
                isinstance(x, torch.Tensor) and x.dtype in _LOW for x in tree_leaves(args)
            ):
                kwargs["dtype"] = torch.float32
        if name == "scaled_dot_product_attention":
            return _cuda_sdpa(*args, tracker=self.tracker, **kwargs)
        if name == "dropout":
            return _cuda_dropout(*args, **kwargs)

        return func(*args, **kwargs)


def _cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """CUDA's dropout is the fused ``native_dropout``: it saves a 1-byte mask, where the CPU's saves a mask in the
    input's dtype."""
    if not training or p == 0.0 or inplace or not torch.is_grad_enabled():
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _cuda_sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, is_causal: bool,
                      enable_gqa: bool) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` picks on an sm90 GPU (flash, efficient, or math)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "math"
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    d, dv = q.shape[-1], v.shape[-1]
    same_heads = hq == hk == hv
    gqa = enable_gqa and hk == hv and hq % hk == 0
    if (q.dtype in _LOW and attn_mask is None and d == dv == k.shape[-1] and d <= 256
            and (same_heads or gqa) and not (is_causal and q.shape[-2] != k.shape[-2])):
        return "flash"
    # Memory-efficient attention supports fp32 and masks, but not grouped-query attention.
    alignment = 8 if q.dtype in _LOW else 4
    if same_heads and d % alignment == 0 and dv % alignment == 0:
        return "efficient"
    return "math"


def _cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, tracker: _LiveTracker | None = None) -> torch.Tensor:
    kernel = _cuda_sdpa_kernel(query, key, value, attn_mask, is_causal, enable_gqa)
    if kernel == "math":
        dtype = query.dtype
        if dtype in _LOW:  # on CUDA the math kernel computes half-precision inputs in fp32
            query, key, value = query.float(), key.float(), value.float()
        out = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
        return out.to(dtype)
    flops = _attention_flops(query, key, is_causal)
    if tracker is not None:
        tracker.add_attention_flops(flops)
    return _FusedAttention.apply(query, key, value, kernel, tracker, flops)


class _FusedAttention(torch.autograd.Function):
    """The memory of CUDA's flash / memory-efficient attention: what they allocate, save and free (no math)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str,
                tracker: _LiveTracker | None = None, flops: float = 0.0) -> torch.Tensor:
        ctx.tracker, ctx.flops = tracker, flops
        b, h, t, _ = q.shape
        # Both kernels write the output as (B, T, H, D) and return a transposed view: the usual
        # `out.transpose(1, 2).contiguous()` that follows costs nothing.
        out = q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)
        lse_len = t if kernel == "flash" else -(-t // 32) * 32
        lse = q.new_empty((b, h, lse_len), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        b, h, t, d = q.shape
        tk, hk = k.shape[2], k.shape[1]
        workspace = []
        if ctx.kernel == "flash":  # FlashAttention-2: softmax_d and an fp32 dq accumulator, rounded up
            t_round = -(-t // 128) * 128
            d_round = -(-d // (32 if d <= 128 else 64)) * (32 if d <= 128 else 64)
            workspace.append(q.new_empty((b, h, t_round), dtype=torch.float32))
            workspace.append(q.new_empty((b, t_round, h, d_round), dtype=torch.float32))
        else:
            workspace.append(q.new_empty((b, h, t), dtype=torch.float32))
            if q.dtype != torch.float32:
                workspace.append(q.new_empty((b, t, h, d), dtype=torch.float32))
        dq = q.new_empty((b, t, h, d)).transpose(1, 2)
        if hk != h:  # grouped-query: gradients per query head first, then summed into the key/value heads
            workspace.append(k.new_empty((b, tk, h, k.shape[-1])))
            workspace.append(v.new_empty((b, tk, h, v.shape[-1])))
        dk = k.new_empty((b, tk, hk, k.shape[-1])).transpose(1, 2)
        dv = v.new_empty((b, tk, hk, v.shape[-1])).transpose(1, 2)
        del workspace
        if ctx.tracker is not None:
            ctx.tracker.add_attention_flops(2.5 * ctx.flops)  # five matmuls against the forward's two
        return dq, dk, dv, None, None, None


# -- where are we -------------------------------------------------------------------------------------------
class _Where:
    """The block (or top-level module) running now: a stack in forward, autograd node labels in backward."""

    def __init__(self, model: nn.Module):
        names = {id(m): name for name, m in model.named_modules()}
        blocks = _auto_blocks(model)
        self.root = type(model).__name__  # the top level: embeddings, head and loss live here
        self.labels = {key: self._label(name, blocks) or self.root for key, name in names.items()}
        self.stack: list[str] = []
        self.backward_label = ""
        self.in_backward = False
        self._handles: list[Any] = []

    @staticmethod
    def _label(name: str, blocks: list[str]) -> str:
        for block in blocks:
            if name == block or name.startswith(block + "."):
                return block
        return name

    def __call__(self) -> str:
        if self.in_backward:
            node = torch._C._current_autograd_node()
            if node is not None:
                label = node.metadata.get("memtrain_module")
                if label is not None:
                    self.backward_label = label
            if self.stack:  # a checkpointed block recomputing its forward
                return self.stack[-1]
            return self.backward_label
        return self.stack[-1] if self.stack else self.root

    def around(self, module: nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a checkpointed block's own forward) run as that block: its recompute in backward is called
        directly, not through the module, so no module hook says where it runs."""
        label = self.labels.get(id(module))

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            depth = len(self.stack)
            self.stack.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                # Also what the module hooks inside pushed and could not pop: checkpoint stops a recompute early
                # by raising once it has what backward needs.
                del self.stack[depth:]

        return run if label is not None else fn

    def _pre(self, module: nn.Module, args: Any) -> None:
        label = self.labels.get(id(module))
        if label is not None:
            self.stack.append(label)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        label = self.labels.get(id(module))
        if label is None:
            return
        if self.stack:
            self.stack.pop()
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and "memtrain_module" not in t.grad_fn.metadata:
                t.grad_fn.metadata["memtrain_module"] = label

    def __enter__(self) -> _Where:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


class _BlockMeter(MemoryMeter):
    """``MemoryMeter`` that also attributes each saved storage to the block (and the run) that saved it."""

    def __init__(self, model: nn.Module, where: _Where, tracker: _LiveTracker):
        super().__init__(model)
        self.where = where
        self.tracker = tracker
        self.per_block: dict[str, int] = {}

    def _count(self, t: torch.Tensor) -> None:
        if self._is_model_state(t):
            return
        key, nbytes = _storage_key(t)
        # Keyed by allocation, not only by address: offloaded storages die in forward, and a later one can reuse
        # the address of one counted already.
        entry = self.tracker.live.get(key)
        unique = (key, entry[2] if entry is not None else None)
        if unique not in self._saved:
            self._saved[unique] = nbytes  # type: ignore[index]
            label = self.where()
            self.per_block[label] = self.per_block.get(label, 0) + nbytes
            self.tracker.mark_saved(t)
            run = self.tracker.run_here()
            if run is not None:
                run.saved_bytes += nbytes


# -- activation offload, simulated --------------------------------------------------------------------------
@dataclass(eq=False)
class _HostRecord:
    index: int  # in the order of saving
    nbytes: int  # the whole storage: what crosses the link, and what comes back
    device: torch.device
    packs: int = 0
    unpacks: int = 0
    restored: torch.Tensor | None = None  # the storage back on the device (uint8), while backward needs it


class _SimulatedOffload:
    """The device memory of ``ActivationOffloader`` on tensors without data.

    A saved tensor the offloader would move (at least ``min_bytes``, not a parameter, a buffer or a cast or view
    of one, not saved by the head) leaves the device in forward: nothing keeps a reference to it, so its storage
    dies with its last other user. In backward its whole storage comes back (views of one storage share it),
    ``prefetch_depth`` records ahead of use, and is let go once its last user has unpacked it. Re-entrant, as the
    offloader is (every offloaded block enters the same one). The meter still counts every saved tensor.
    """

    def __init__(self, meter: MemoryMeter, state_storages: set[int], *, min_bytes: int, prefetch_depth: int = 2,
                 frozen_shapes: frozenset[tuple[int, ...]] = frozenset()):
        self.meter = meter
        self.state_storages = state_storages
        self.frozen_shapes = frozen_shapes  # the shapes of frozen parameters: their autocast casts stay too
        self.min_bytes = min_bytes
        self.prefetch_depth = prefetch_depth
        self.records: list[_HostRecord] = []
        self._by_storage: dict[int, tuple[weakref.ref, _HostRecord]] = {}
        self._hooks: list[Any] = []
        self.in_tail = False  # the head has started: logits and the loss stay on the device

    @property
    def host_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def __enter__(self) -> _SimulatedOffload:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.pop().__exit__(*exc)

    def _keeps(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()
        if t.layout != torch.strided or storage.nbytes() < self.min_bytes or self.in_tail:
            return True
        if isinstance(t, nn.Parameter) or storage._cdata in self.state_storages:
            return True
        # The offloader's own rules (ActivationOffloader._keep_reason): parameters' views, casts and copies stay.
        base = t if t._base is None else t._base
        if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad) or _derived_from_leaf(t):
            return True
        return (base.grad_fn is None and not base.requires_grad and base.is_floating_point()
                and tuple(base.shape) in self.frozen_shapes)

    def _pack(self, t: torch.Tensor) -> Any:
        self.meter._count(t)  # saved-tensor hooks do not stack: the meter's own would not see this tensor
        if self._keeps(t):
            return t
        storage = t.untyped_storage()
        entry = self._by_storage.get(storage._cdata)
        if entry is None or entry[0]() is not storage:  # a storage address reused after a free is another tensor
            entry = (weakref.ref(storage), _HostRecord(len(self.records), storage.nbytes(), t.device))
            self._by_storage[storage._cdata] = entry
            self.records.append(entry[1])
            run = self.meter.tracker.run_here() if isinstance(self.meter, _BlockMeter) else None
            if run is not None:
                run.offloaded_bytes += entry[1].nbytes
                run.offloaded_sizes.append(entry[1].nbytes)
        record = entry[1]
        record.packs += 1
        return record, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype

    def _restore(self, record: _HostRecord) -> None:
        if record.restored is None and record.unpacks < record.packs:
            record.restored = torch.empty(record.nbytes, dtype=torch.uint8, device=record.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        record, shape, stride, offset, dtype = packed
        self._restore(record)
        for earlier in reversed(self.records[max(0, record.index - self.prefetch_depth):record.index]):
            self._restore(earlier)  # prefetched: backward uses records in about the reverse order of saving
        restored = record.restored
        assert restored is not None
        record.unpacks += 1
        if record.unpacks >= record.packs:
            record.restored = None  # the offloader lets go; autograd's reference keeps it while it is used
        return torch.empty((0,), dtype=dtype, device=restored.device).set_(restored.untyped_storage(), offset, shape,
                                                                          stride)

    def end_of_backward(self) -> None:
        for record in self.records:
            record.restored = None


def _simulate_offload(model: nn.Module, offload: _SimulatedOffload) -> int:
    """Points every wrapped block that offloads (its saved inputs, or all it saves) at ``offload``; returns how
    many do."""
    import dataclasses

    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, _CheckpointedForward) and (forward.spec.offloader is not None
                                                          or forward.spec.policy == "offload"):
            forward.spec = dataclasses.replace(forward.spec, offloader=offload)  # type: ignore[arg-type]
            module._memtrain_checkpoint = forward.spec
            count += 1
    return count


# -- the estimate -------------------------------------------------------------------------------------------
_FRIENDLY = {
    "_log_softmax": "log-softmax of the logits",
    "_log_softmax_backward_data": "logits grad",
    "nll_loss_backward": "loss grad wrt log-probs",
}


def _describe(nbytes: int, label: tuple[Any, ...], grad_of: str | None) -> str:
    phase, where, op, shape, dtype = label
    what = f"grad of {grad_of}" if grad_of else _FRIENDLY.get(op, f"{op} output")
    if op == "_to_copy" and not grad_of:
        what = f"cast to {str(dtype).replace('torch.', '')}"
    dims = "x".join(str(d) for d in shape)
    return f"{what} {format_bytes(nbytes)} ({dims} {str(dtype).replace('torch.', '')})"


_WEIGHT_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Work that keeps estimate bounded: a real model has at most a few hundred blocks, and a step whose loss needs
# more chunks than this holds far more tokens than any device (it is refused before anything is traced).
MAX_LAYERS = 10_000
MAX_LOSS_CHUNKS = 65_536


@dataclass(frozen=True)
class Trace:
    """What one traced step showed: the report, and the runs (per block, per phase) the planner composes."""

    report: MemoryReport
    runs: tuple[Run, ...]  # forward, then backward, in order
    blocks: tuple[str, ...]  # the model's repeated blocks, in order (wrapped or not)
    block_parameter_bytes: tuple[int, ...]  # bytes of the trainable parameters of each block
    trainable_bytes: int  # bytes of every trainable parameter (their gradients' bytes, in the same dtypes)
    state_bytes: int  # optimizer state on the device
    step_temp_bytes: int  # the optimizer step's temporaries on the device
    fixed_bytes: int  # allocated before forward: parameters, buffers, inputs, optimizer state, workspaces
    host_bytes: int  # optimizer state and offloaded activations in host memory
    offloaded_bytes: int  # of host_bytes, the activations (they cross the host link twice a step)
    forward_end_bytes: int  # bytes alive when forward ended, before autocast's cast cache was let go


def _convert_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's floating-point parameters in ``dtype``, in place (ties kept): e.g. bf16 device weights whose
    fp32 master lives with an offloaded optimizer."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]


def estimate(
    model: Any,
    batch: Any = None,
    *,
    device: str = "cuda",
    precision: Precision = "fp32",
    checkpointing: Any = "none",
    offload_activations: bool = False,
    optimizer: OptimizerKind = "adamw",
    state_precision: str = "fp32",
    offload_fraction: float = 0.0,
    step_in_backward: bool = False,
    chunked_loss: bool = False,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    accumulation: int = 1,
    weights_dtype: str | None = None,
    keep_output: bool = False,
    replay: bool = True,
) -> MemoryReport:
    """Predicts a training step's peak memory by running it on fake tensors: seconds of CPU, no device memory.

    The step is the steady state a training loop reaches from its second step on: forward with labels (the
    loss on fp32 logits for causal LMs), backward, optimizer step, ``zero_grad(set_to_none=True)``, with the
    optimizer state already allocated and only the loss kept from the forward's output. The first step's
    peak is lower (no optimizer state yet). With ``accumulation > 1`` it is the window's later micro-batches,
    which run with every gradient of the earlier ones alive (unless they stream to the host).

    Args:
        model: an ``nn.Module`` (on any device, the meta device included; it is not modified and its data is
            not copied) or a Hugging Face ``PretrainedConfig`` (built with ``AutoModelForCausalLM.from_config``
            on the meta device).
        batch: a token tensor (any device), a shape such as ``(4, 2048)``, or a dict of model inputs (tensors or
            shapes); ``None`` with ``micro_batch_size`` and ``seq_len`` means ``(micro_batch_size, seq_len)``.
        device: ``"cuda"`` (CUDA autocast lists and attention kernels, 512-byte allocator blocks, cuBLAS
            workspaces) or ``"cpu"`` (the CPU's own kernels, as ``measure`` sees them).
        precision: ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"`` (autocast; parameters keep their dtype).
        checkpointing: ``"none"``, ``"all"``, ``"every:K"`` / ``K``, or a dict of ``apply_checkpointing``
            arguments (per-block ``policies`` included); applied to a copy of the model.
        offload_activations: activations in pinned host memory, as ``memtrain train --offload-activations`` does:
            with checkpointing, the recomputed blocks' saved inputs; without, every saved tensor of 1 MiB or more
            outside the head. Blocks with an ``"offload"`` policy offload whatever they save either way. Simulated
            exactly (what leaves the device, what comes back and when, two records prefetched ahead).
        optimizer: ``"adamw"`` (fused), ``"sgd"``, ``"sgd-momentum"``, ``"adafactor"`` or ``"adamw-offload"``
            (``CPUOffloadOptimizer``: state on the host, gradients streamed there as they are produced).
        state_precision, offload_fraction, step_in_backward: AdamW as ``memtrain.optim.build_optimizer`` builds
            it: moments in ``"fp32"``, ``"bf16"`` or ``"int8"``; that share of the parameters' state in host RAM
            (their gradients streamed there); each parameter stepping in backward, its gradient freed at once.
        chunked_loss: the loss computed with ``memtrain.loss.apply_chunked_loss`` (the model's own chunk size
            when its loss is chunked already, else 1024 tokens of logits at a time) instead of on the whole
            batch's fp32 logits; applied to a copy of the model.
        micro_batch_size, seq_len: override the batch's first and second dimensions.
        accumulation: micro-batches per optimizer step.
        weights_dtype: ``"bf16"`` / ``"fp16"`` / ``"fp32"``: the parameters' dtype on the device (e.g. bf16 weights
            whose fp32 master lives with ``"adamw-offload"``); None keeps the model's.
        keep_output: the loop holds the forward's output object (its logits) until the step ends, as
            ``out = model(...); out.loss.backward()`` does; False (the default, memtrain's own loop, and
            ``model(...).loss.backward()``) keeps only the loss.
        replay: on meta tensors (``device="cuda"``), reuse the output shapes of identical earlier op calls
            instead of running torch's meta functions again (same result, several times faster on deep models).

    Returns:
        A ``MemoryReport`` with ``source="estimated"``: parameter, gradient, optimizer-state and saved-activation
        bytes (activations exactly as ``measure`` counts them), ``peak_bytes`` (the predicted device peak),
        ``peak_phase`` (where, and the largest tensors alive there), ``phase_bytes`` (bytes alive after
        forward, backward and step), ``host_bytes`` and ``assumptions`` (including the breakdown at the peak).

    Raises:
        ConfigError: an unknown device, precision, optimizer or checkpointing policy; a batch that is missing,
            does not fit the model, or is too large to trace in bounded time. Every problem at once.
        MemtrainError: the model's forward cannot run on fake tensors (the message names the module).

    Example:
        >>> from memtrain.models import GPT, GPT_PRESETS
        >>> with torch.device("meta"):
        ...     model = GPT(GPT_PRESETS["gpt-tiny"])
        >>> report = estimate(model, (8, 64), device="cpu")
        >>> report.source, report.peak_bytes > report.parameter_bytes
        ('estimated', True)
    """
    return trace(model, batch, device=device, precision=precision, checkpointing=checkpointing,
                 offload_activations=offload_activations, optimizer=optimizer, state_precision=state_precision,
                 offload_fraction=offload_fraction, step_in_backward=step_in_backward, chunked_loss=chunked_loss,
                 micro_batch_size=micro_batch_size, seq_len=seq_len, accumulation=accumulation,
                 weights_dtype=weights_dtype, keep_output=keep_output, replay=replay).report


def trace(
    model: Any,
    batch: Any = None,
    *,
    device: str = "cuda",
    precision: Precision = "fp32",
    checkpointing: Any = "none",
    offload_activations: bool = False,
    optimizer: OptimizerKind = "adamw",
    state_precision: str = "fp32",
    offload_fraction: float = 0.0,
    step_in_backward: bool = False,
    chunked_loss: bool = False,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    accumulation: int = 1,
    weights_dtype: str | None = None,
    keep_output: bool = False,
    replay: bool = True,
    runs: bool = False,
    offload_min_bytes: int = MIN_BYTES_DEFAULT,
) -> Trace:
    """``estimate``'s step, with what the planner composes plans from: the bytes and work of every block's
    forward and backward (``runs=True`` records them; ``Trace.runs`` is empty otherwise). Same arguments, and
    ``offload_min_bytes``, the smallest storage the simulated offloader moves (the real one's by default)."""
    problems: list[str] = []
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError):
        device_type = str(device)
    _check_choice("device", device_type, ("cuda", "cpu"), problems)
    if not isinstance(offload_activations, bool):
        problems.append(f"offload_activations={offload_activations!r} must be True or False. To resolve this "
                        "error, pass offload_activations=True or False.")
    if not isinstance(chunked_loss, bool):
        problems.append(f"chunked_loss={chunked_loss!r} must be True or False. To resolve this error, pass "
                        "chunked_loss=True or False.")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        problems.append(f"accumulation={accumulation!r} must be an integer >= 1 (micro-batches per step). To "
                        "resolve this error, pass e.g. accumulation=1.")
    if weights_dtype not in _WEIGHT_DTYPES:
        problems.append(f"weights_dtype={weights_dtype!r} is not known. To resolve this error, pass one of "
                        f"{[k for k in _WEIGHT_DTYPES if k]} or None (the model's own).")
    _check_choice("precision", precision, get_args(Precision), problems)
    _check_choice("optimizer", optimizer, get_args(OptimizerKind), problems)
    _check_choice("state_precision", state_precision, ("fp32", "bf16", "int8"), problems)
    if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)) or not (
            0.0 <= offload_fraction <= 1.0):
        problems.append(f"offload_fraction={offload_fraction!r} must be a number in [0, 1]. To resolve this "
                        "error, pass e.g. offload_fraction=1.0 (every parameter's state on the host) or 0.")
    if not isinstance(step_in_backward, bool):
        problems.append(f"step_in_backward={step_in_backward!r} must be True or False. To resolve this error, "
                        "pass step_in_backward=True or False.")
    lean = state_precision != "fp32" or bool(offload_fraction) or step_in_backward is True
    if lean and optimizer not in ("adamw", "adamw-offload"):
        problems.append(f"state_precision/offload_fraction/step_in_backward are options of AdamW (memtrain.optim), "
                        f"not of optimizer={optimizer!r}. To resolve this error, pass optimizer='adamw'.")
    ckpt = _checkpointing_kwargs(checkpointing, problems)
    spec = _batch_spec(batch, micro_batch_size, seq_len, problems)
    _check_layers(model, problems)
    ConfigError.raise_if(problems)
    assert spec is not None
    on_cuda = device_type == "cuda"
    round_to = _CUDA_BLOCK if on_cuda else 1
    autocast_dtype = _AUTOCAST_DTYPES[precision]

    meta = _meta_model(model)
    meta.train()
    if getattr(getattr(meta, "config", None), "use_cache", False):
        meta.config.use_cache = False  # as memtrain trains: a KV cache only holds memory in a training step
    if _WEIGHT_DTYPES[weights_dtype] is not None:
        _convert_weights(meta, _WEIGHT_DTYPES[weights_dtype])
    max_pos = _max_positions(meta)
    tokens = 0
    if "input_ids" in spec and len(spec["input_ids"][0]) >= 2:
        shape = spec["input_ids"][0]
        tokens = _numel(shape)
        if max_pos is not None and shape[1] > max_pos:
            problems.append(f"batch: sequences of {shape[1]} tokens are longer than the model's {max_pos} positions. "
                            f"To resolve this error, pass seq_len <= {max_pos} or a config with more positions.")
    if chunked_loss and not supports_chunked_loss(meta):
        problems.append(f"chunked_loss=True: memtrain.loss cannot chunk the loss of {type(meta).__name__} "
                        f"(model type {getattr(getattr(meta, 'config', None), 'model_type', None)!r}; it knows "
                        f"GPT and {sorted(HF_MODEL_TYPES)}). To resolve this error, pass chunked_loss=False.")
    chunk_tokens = chunk_tokens_of(meta) or 1024  # the model's own chunk size when its loss is chunked already
    if chunked_loss and tokens > MAX_LOSS_CHUNKS * chunk_tokens:
        problems.append(f"batch: {tokens:,} tokens per micro-batch make {tokens // chunk_tokens:,} loss chunks of "
                        f"{chunk_tokens}, more than estimate traces in bounded time ({MAX_LOSS_CHUNKS:,}); no device "
                        "holds such a micro-batch. To resolve this error, pass a smaller micro-batch or sequence "
                        "length (accumulate micro-batches to reach the batch you want).")
    ConfigError.raise_if(problems)
    remove_checkpointing(meta)
    kwargs = ckpt.arguments(meta) if isinstance(ckpt, Checkpointing) else ckpt
    offloads = offload_activations or "offload" in ((kwargs or {}).get("policies") or {}).values()
    if kwargs is not None:
        if offload_activations:
            kwargs["offload"] = True  # as train does: the recomputed blocks' saved inputs
        if offloads or kwargs.get("offload"):
            offloads = True
            kwargs.setdefault("offloader", ActivationOffloader(None))  # a stand-in, replaced below
        apply_checkpointing(meta, **kwargs)
    remove_chunked_loss(meta)
    if chunked_loss:
        apply_chunked_loss(meta, chunk_tokens=chunk_tokens)

    # CUDA: meta tensors (fast: the CUDA rules above choose kernels and dtypes). CPU: fake CPU tensors, so that
    # the CPU's own kernel choices (attention) and autocast apply exactly as in a real CPU run.
    fake_mode: Any = _nullcontext()
    if not on_cuda:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # stray tensor attributes become fake
        _to_fake(meta, fake_mode)
    with fake_mode:
        inputs = {key: torch.empty(shape, dtype=dtype, device="meta" if on_cuda else "cpu")
                  for key, (shape, dtype) in spec.items()}
    run = _call_convention(meta, spec, isinstance(batch, Mapping))

    params = list(dict.fromkeys(p for p in meta.parameters()))
    trainable = [p for p in params if p.requires_grad]
    # Gradients that do not stay on the device once accumulated: CPUOffloadOptimizer (one process) copies each to
    # the host as autograd produces it; a parameter that steps in backward frees its own.
    leaving: list[nn.Parameter] = []
    if not (lean or optimizer == "adamw-offload"):
        state_bytes, step_temp_bytes, optimizer_host_bytes, optimizer_note = _optimizer_bytes(
            trainable, optimizer, round_to, on_cuda)
        all_state_bytes = state_bytes
    else:  # memtrain.optim's AdamW, CPUOffloadOptimizer (adamw-offload: every parameter's state) included
        from memtrain.optim import offloaded_mask, optimizer_memory

        fraction = 1.0 if optimizer == "adamw-offload" else offload_fraction
        memory = optimizer_memory([(p.numel(), p.dtype) for p in trainable], state_precision=state_precision,
                                  offload_fraction=fraction, step_in_backward=step_in_backward,
                                  accumulation_steps=accumulation, device_type=device_type)
        state_bytes, step_temp_bytes = memory.device_state_bytes, memory.device_step_temp_bytes
        optimizer_host_bytes, all_state_bytes = memory.host_bytes, memory.state_bytes
        on_host = offloaded_mask([p.numel() for p in trainable], fraction)
        leaving = [p for p, h in zip(trainable, on_host, strict=True)
                   if h or (step_in_backward and accumulation == 1)]
        optimizer_note = (f"AdamW from memtrain.optim.build_optimizer: {state_precision} moments, {fraction:.0%} of "
                          f"the parameters' state in host RAM, step in backward {'on' if step_in_backward else 'off'}"
                          " (bytes from memtrain.optim.optimizer_memory; step temporaries an upper bound)")
        if fraction:
            optimizer_note += ("; offloaded parameters' fp32 masters, moments and gradient buffers in pinned host "
                               "memory, their device gradients counted in full (streaming frees them earlier, so "
                               "the device figure is an upper bound)")
    streamed = bool(leaving)
    where = _Where(meta)
    tracker = _LiveTracker(round_to, where)
    tracker.recording = runs
    if on_cuda and replay:
        tracker.replay = {}
    for name, p in meta.named_parameters():
        tracker.add(p, ("state", name, "parameter", tuple(p.shape), p.dtype))
    for name, b in meta.named_buffers():
        tracker.add(b, ("state", name, "buffer", tuple(b.shape), b.dtype))
    for name, t in inputs.items():
        tracker.add(t, ("input", name, "input", tuple(t.shape), t.dtype))
    tracker.add_bytes(state_bytes)
    workspace = _CUDA_WORKSPACE_BYTES if on_cuda else 0
    tracker.add_bytes(workspace)
    hooks = []
    if streamed:
        def drop(p: torch.Tensor) -> None:
            p.grad = None

        hooks = [p.register_post_accumulate_grad_hook(drop) for p in leaving]
    if accumulation > 1:
        # A later micro-batch of the window: the earlier ones' gradients are alive from its start, and its own
        # backward adds into them in place.
        with fake_mode, tracker:
            for p in {id(p): p for p in trainable if p not in set(leaving)}.values():
                p.grad = torch.empty_like(p)
    if runs and not streamed and accumulation == 1:
        # Which run each gradient came into being in, and whether before its peak: what a streaming optimizer (or
        # accumulation, which adds each new gradient into the old one and frees it) would not hold there.
        # Keyed by the gradient's allocation serial; the landing serial is when a streaming optimizer takes it
        # (the chunked loss allocates the head's gradient at its first chunk and fills it over the others).
        landed: dict[int, tuple[int, int, int]] = {}

        def note(p: torch.Tensor) -> None:
            entry = tracker.live.get(p.grad.untyped_storage()._cdata)
            if entry is not None and tracker.runs and entry[2] not in landed:
                landed[entry[2]] = (entry[0], len(tracker.runs) - 1, tracker._serial)

        hooks = [p.register_post_accumulate_grad_hook(note) for p in trainable]
    fixed_bytes = tracker.current

    rules = _CudaRules(autocast_dtype) if on_cuda else None
    for module in meta.modules():
        wrapped = module.__dict__.get("forward")
        if isinstance(wrapped, _CheckpointedForward):
            wrapped.original = where.around(module, wrapped.original)
            if rules is not None:
                wrapped.original = rules.around_recompute(wrapped.original)
    if rules is not None:
        rules.tracker = tracker
        if chunked_loss:  # each chunk's logits are recomputed in backward: under the same rules
            head = output_head(meta)
            head.forward = rules.around_recompute(head.forward)  # type: ignore[method-assign]
    cpu_autocast = (torch.autocast("cpu", dtype=autocast_dtype, cache_enabled=False) if (autocast_dtype and not on_cuda)
                    else _nullcontext())
    meter = _BlockMeter(meta, where, tracker)
    offload = None
    whole_forward: Any = _nullcontext()
    if offloads:
        state_storages = {t.untyped_storage()._cdata for t in (*meta.parameters(), *meta.buffers())}
        offload = _SimulatedOffload(meter, state_storages, min_bytes=offload_min_bytes, frozen_shapes=frozenset(
            tuple(p.shape) for p in params if not p.requires_grad))
        if not _simulate_offload(meta, offload) and offload_activations:
            # No checkpointing: the whole forward is offloaded, but for what the head and the loss save.
            whole_forward = offload
            head = _find_head(meta)
            if head is not None:
                head.register_forward_pre_hook(lambda module, args: setattr(offload, "in_tail", True))
    phase_bytes: list[tuple[str, int]] = []
    with _hf_sees_real_tensors(), fake_mode, tracker, where, meter, (rules or _nullcontext()):
        # -- forward (inside autocast: CUDA's emulated, or the CPU's own)
        if rules is not None:
            rules.autocast, rules.cache = True, None  # MixedPrecision.autocast() keeps no weight-cast cache
        try:
            with cpu_autocast, whole_forward:
                out = run(inputs)
                loss = _as_loss(out)
                if not keep_output:
                    out = None  # as memtrain's loop does: only the loss outlives forward (and the logits die)
                before_release = dict(tracker.live)  # autocast's cast cache dies with its region
        except MemtrainError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the module and the fix
            module = where.stack[-1] if where.stack else type(meta).__name__
            raise MemtrainError(
                f"estimate: the forward of {module!r} failed on fake tensors (shapes only, no values): "
                f"{describe_exception(e)}. This happens when a module reads "
                "tensor values (.item(), .tolist(), data-dependent shapes, numpy) or when the batch does not fit "
                "the model. To resolve this error, check the batch's shape and dtype against the model, or make "
                "that module's forward shape-only (e.g. precompute the value it reads); or, on a device with "
                "memory, use memtrain.measure instead."
            ) from None
        if rules is not None:
            rules.cache = None  # autocast's cast cache dies when the autocast region ends
        tracker.snapshot()
        forward_end_bytes = tracker.current + sum(v[0] for k, v in before_release.items() if k not in tracker.live)
        _attribute_release(tracker, before_release)
        tracker.end_runs()
        phase_bytes.append(("forward", tracker.current))
        meter.mark("forward")
        # -- backward (autograd turns grad mode off; only checkpoint recomputes run with it, under autocast)
        tracker.phase, where.in_backward = "backward", True
        where.stack.clear()
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001 - re-raised with the place and the fix
            raise MemtrainError(
                f"estimate: the backward failed on fake tensors near {where.backward_label or type(meta).__name__!r}: "
                f"{describe_exception(e)}. To resolve this error, estimate "
                "without checkpointing to see whether the recompute is the cause, or use memtrain.measure on a "
                "device with memory."
            ) from None
        if offload is not None:
            offload.end_of_backward()
        where.in_backward = False
        tracker.end_runs()
        meter.mark("backward")
        tracker.snapshot()
        phase_bytes.append(("backward", tracker.current))
        if rules is not None:
            rules.autocast = False
        # -- optimizer step: parameters, gradients and state at once, plus the step's temporaries
        tracker.phase = "optimizer step"
        grad_names = {tracker.live[k][2]: name for name, k in (
            (name, p.grad.untyped_storage()._cdata) for name, p in meta.named_parameters() if p.grad is not None
        ) if k in tracker.live}
        tracker.add_bytes(step_temp_bytes)
        tracker.snapshot()
        phase_bytes.append(("step", tracker.current))
        peak_live, (peak_phase_name, peak_where) = tracker.peak_live, tracker.peak_at
        del out, loss
    for handle in hooks:
        handle.remove()
    if runs and not streamed and accumulation == 1:
        for allocated, (nbytes, index, serial) in landed.items():
            run = tracker.runs[index]
            run.gradient_bytes += nbytes
            run.gradients.append((serial, nbytes))
            if allocated <= run.peak_serial:
                run.gradient_bytes_at_peak += nbytes
    measured = meter.report()

    # -- the peak, explained
    by_category = {"parameters": 0, "gradients": 0, "saved activations": 0, "other live tensors": 0}
    for nbytes, label, serial in peak_live.values():
        category = ("parameters" if label[2] in ("parameter", "buffer") else "gradients" if serial in grad_names
                    else "saved activations" if serial in tracker.saved_serials else "other live tensors")
        by_category[category] += nbytes
    by_category["optimizer state"] = state_bytes
    if peak_phase_name == "optimizer step":
        by_category["optimizer step temporaries"] = step_temp_bytes
    if workspace:
        by_category["cuBLAS workspaces"] = workspace
    largest = sorted((v for v in peak_live.values() if v[1][2] not in ("parameter", "buffer")), key=lambda v: -v[0])[:3]
    peak_phase = peak_phase_name if peak_phase_name == "optimizer step" else f"{peak_phase_name} of {peak_where}"
    if peak_phase_name == "optimizer step" and step_temp_bytes:
        peak_phase += f": optimizer step temporaries {format_bytes(step_temp_bytes)}"
    elif largest:
        peak_phase += ": " + ", ".join(_describe(n, label, grad_names.get(serial)) for n, label, serial in largest)

    offloaded_bytes = offload.host_bytes if offload is not None else 0
    host_bytes = optimizer_host_bytes + offloaded_bytes
    assumptions = [
        "steady-state step (optimizer state allocated); forward with labels, backward, optimizer step, "
        "zero_grad(set_to_none=True); "
        + ("the forward's output (logits) is kept until the step ends" if keep_output else
           "only the loss outlives forward (the output's logits die with it)"),
        optimizer_note,
        "at the peak: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in by_category.items() if v),
    ]
    if accumulation > 1:
        assumptions.append(f"a later micro-batch of {accumulation} in the window: "
                           + ("gradients stream to the host, none accumulate on the device" if streamed else
                              "every gradient of the earlier ones is alive from its start"))
    if weights_dtype is not None:
        assumptions.append(f"device weights in {weights_dtype}")
    if on_cuda:
        assumptions.append(
            "CUDA rules: autocast op lists, the attention kernel CUDA picks on sm90 (flash for fp16/bf16 without a "
            "mask, memory-efficient for fp32 without grouped-query heads, else the math kernel), allocations "
            "rounded to 512-byte blocks (memory_allocated, not reserved: add allocator fragmentation on top)"
        )
    if kwargs is not None:
        shown = {k: v for k, v in kwargs.items() if k != "offloader"}
        assumptions.append(f"checkpointing: apply_checkpointing({', '.join(f'{k}={v!r}' for k, v in shown.items())})")
    if chunked_loss:
        assumptions.append(f"loss: apply_chunked_loss ({chunk_tokens} tokens of fp32 logits at a time, recomputed "
                           "in backward)")
    if offload is not None:
        assumptions.append(
            f"activation offload: {format_bytes(offloaded_bytes)} of saved activations ({len(offload.records)} "
            "storages of 1 MiB or more, not parameters or their casts) in pinned host memory, back on the device "
            "when backward needs them, two prefetched ahead; a copy's device memory is freed when it is issued (the "
            "copy's own latency is not modelled)"
        )
    report = MemoryReport(
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        gradient_bytes=measured.gradient_bytes,
        optimizer_state_bytes=all_state_bytes,
        activation_bytes=measured.activation_bytes,
        activation_tensors=measured.activation_tensors,
        device=device_type,
        source="estimated",
        peak_bytes=tracker.peak,
        peak_phase=peak_phase,
        phase_bytes=tuple(phase_bytes),
        host_bytes=host_bytes,
        assumptions=tuple(assumptions),
    )
    modules = dict(meta.named_modules())
    block_names = tuple(_auto_blocks(meta))
    return Trace(
        report=report,
        runs=tuple(r for r in tracker.runs if r.phase != "-"),
        blocks=block_names,
        block_parameter_bytes=tuple(sum(p.numel() * p.element_size() for p in modules[name].parameters()
                                        if p.requires_grad) for name in block_names),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        state_bytes=state_bytes,
        step_temp_bytes=step_temp_bytes,
        fixed_bytes=fixed_bytes,
        host_bytes=host_bytes,
        offloaded_bytes=offloaded_bytes,
        forward_end_bytes=forward_end_bytes,
    )


def _attribute_release(tracker: _LiveTracker, before: dict[int, tuple[int, tuple[Any, ...], int]]) -> None:
    """Books the bytes freed when forward's autocast region ended (its cast cache) to the forward runs that
    allocated them."""
    released: dict[str, int] = {}
    for key, (nbytes, label, _) in before.items():
        if key not in tracker.live and label[0] == "forward":
            released[label[1]] = released.get(label[1], 0) + nbytes
    seen: set[str] = set()
    for run in tracker.runs:  # the first forward run of each place takes its bytes
        if run.phase == "forward" and run.label in released and run.label not in seen:
            run.released_bytes = released[run.label]
            seen.add(run.label)


def _check_layers(model: Any, problems: list[str]) -> None:
    """Refuses a model too deep to trace in bounded time, before building it."""
    config = getattr(model, "config", model)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        layers = getattr(config, attr, None)
        if isinstance(layers, int) and layers > MAX_LAYERS:
            problems.append(f"{attr}={layers:,}: more layers than estimate traces in bounded time ({MAX_LAYERS:,}; "
                            "the deepest published models have a few hundred). To resolve this error, fix the "
                            "config's layer count.")
            return


@contextlib.contextmanager
def _hf_sees_real_tensors() -> Iterator[None]:
    """Makes Hugging Face take the path a real training batch takes.

    It treats fake tensors as graph tracing, and would then build an explicit attention mask (and repeat grouped
    key/value heads) where the real run passes ``is_causal=True``; and without a KV cache it reads the position
    ids to detect packed sequences, which fake tensors cannot answer. A token batch is unpacked: say so.
    """
    patches = []
    try:
        from transformers import masking_utils
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    if hasattr(import_utils, "is_fake_tensor"):
        patches.append((import_utils, "is_fake_tensor", lambda x: False))
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        patches.append((masking_utils, "find_packed_sequence_indices", lambda position_ids: None))
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in originals:
            setattr(module, name, value)


class _nullcontext:  # noqa: N801 - contextlib.nullcontext, but reusable inside one `with` statement list
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = ["Run", "Trace", "estimate", "hf_config_from_file", "trace"]
