"""The live tracker: every storage alive at every moment of a traced step, as the device allocator sees it.

A dispatch mode sees each allocation (an op output that aliases no input), a weak reference to its storage each
free. Along the way it records the runs the planner composes (a block's forward or backward: bytes at its start and
peak, the work of its ops) and replays the output metadata of identical meta calls (a deep model costs little more
than one block).
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.device import active_simulation
from memtrain.device.allocator import expandable_segments
from memtrain.device.segments import SegmentModel
from memtrain.estimate.cpu import kernel_scratch_bytes
from memtrain.estimate.fake import grouped_mm_output, needs_own_kernel
from memtrain.estimate.values import KnownValues


# -- allocation sizes -------------------------------------------------------------------------------------------
def _storage_elements(t: torch.Tensor) -> int:
    """Elements a fresh tensor of this shape and strides needs."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (an allocator's block size; 1 leaves it as it is)."""
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


# -- the work of an op ----------------------------------------------------------------------------------------
# name -> index of the first matrix argument
_MATMUL_OPS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "_grouped_mm": 0}
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


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def attention_flops(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> float:
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
        return 2.0 * numel(a.shape) * b.shape[-1], 0.0, 0
    if name in ("convolution", "convolution_backward"):
        # weight: (out channels, in channels / groups, *kernel); every output element costs 2 x that many FLOPs.
        weight = args[1] if name == "convolution" else args[2]
        outputs = out if name == "convolution" else args[0]  # the backward's grad_output has the output's shape
        flops = 2.0 * numel(outputs.shape) * numel(weight.shape[1:])
        return (2.0 * flops if name == "convolution_backward" else flops), 0.0, 0  # input grad + weight grad
    if name.startswith("_linear_cross_entropy_batch_chunked"):
        # torch's chunked linear + cross-entropy: the logits (2NHV) and, computed in forward, their gradients with
        # respect to the input and the weight (2NHV each); backward only scales what forward kept.
        hidden, weight = args[0], args[1]
        logits = numel(hidden.shape[:-1]) * weight.shape[0]
        # About 20 bytes of traffic a logit inside: fp32 logits written, the softmax read and written, its
        # gradient read and written, chunk by chunk.
        return 6.0 * numel(hidden.shape) * weight.shape[0], 0.0, 20 * logits
    if name in _ATTENTION_OPS:
        causal = bool(_argument(func, args, kwargs, "is_causal", False))
        return 0.0, attention_flops(args[0], args[1], causal), 0
    if "attention" in name and name.endswith("backward"):
        query, key = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
            causal = bool(_argument(func, args, kwargs, "is_causal", False))
            return 0.0, 2.5 * attention_flops(query, key, causal), 0  # five matmuls against the forward's two
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


# -- the tracker ----------------------------------------------------------------------------------------------
_FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")


class LiveTracker(TorchDispatchMode):
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
        self.serial = 0
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.peak_at: tuple[str, str] = ("", "")
        self.peak_live: dict[int, tuple[int, tuple[Any, ...], int]] = {}
        self._pending = False  # a new peak whose live set is not copied yet
        self.cuda_workspaces = round_to > 1
        self.cpu_kernels = False  # the CPU's kernels run the step: their scratch counts (memtrain.estimate.cpu)
        self.replay: dict[tuple[Any, ...], Any] | None = None  # set to {} to replay meta outputs
        self.runs: list[Run] = []  # forward and backward, in order (see Run)
        self._mutable: dict[Any, bool] = {}  # op -> mutates or aliases (never replayed)
        self.recording = False  # runs are recorded between start_runs() and stop_runs()
        self._log_levels: list[int] = []  # torch's fake-tensor log level before each entry
        self.known = KnownValues()  # constants' real values, for a module that reads one (.item())
        # CUDA's caching allocator's segments over the same allocations: the reserved bytes (expandable segments
        # unless the allocator's settings say otherwise: a memtrain run sets them where the user did not).
        self.segments = _allocator_segments() if round_to > 1 else None

    def __enter__(self) -> LiveTracker:
        # torch logs the traceback of a meta kernel that fails; the trace's own error says it in one line.
        self._log_levels.append(_FAKE_TENSOR_LOG.level)
        _FAKE_TENSOR_LOG.setLevel(logging.CRITICAL)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _FAKE_TENSOR_LOG.setLevel(self._log_levels.pop())
        super().__exit__(*exc)

    def add(self, t: torch.Tensor, label: tuple[Any, ...]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        nbytes = round_up(storage.nbytes(), self.round_to)
        self.serial += 1
        self.live[key] = (nbytes, label, self.serial)
        self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
        if self.segments is not None and nbytes:
            self.segments.malloc(self.serial, nbytes)
        self.add_bytes(nbytes)

    def add_block(self, nbytes: int) -> None:
        """An allocation that stays (the optimizer's state, workspaces): counted, and given a block."""
        self.serial += 1
        if self.segments is not None and nbytes:
            self.segments.malloc(-self.serial, nbytes)
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
            run.serials.append(self.serial)
            if self.current > run.peak_bytes:
                run.peak_bytes = self.current
                run.peak_serial = self.serial
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
            last = Run(self.phase, label, self.current, self.current, curve=[self.current], serials=[self.serial])
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
            if self.segments is not None:
                self.segments.free(entry[2])
            self.current -= entry[0]
            if self.recording and self.runs:
                self.runs[-1].curve.append(self.current)
                self.runs[-1].serials.append(self.serial)

    def snapshot(self) -> None:
        if self._pending:
            self.peak_live = dict(self.live)
            self._pending = False

    def transient(self, nbytes: int, label: tuple[Any, ...]) -> None:
        """An allocation a kernel makes and frees inside itself (a workspace the fake op does not show)."""
        self.serial += 1
        key = -self.serial
        self.live[key] = (round_up(nbytes, self.round_to), label, self.serial)
        if self.segments is not None and nbytes:
            self.segments.malloc(self.serial, self.live[key][0])
        self.add_bytes(self.live[key][0])
        self._free(key, None)  # type: ignore[arg-type]

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Runs ``func``; on meta tensors, replays the output metadata of an identical earlier call instead.

        Identical blocks repeat identical calls, and torch's meta functions are mostly Python: replaying what a
        call produced (shape, strides, dtype) makes a 70B model's 80 layers cost little more than one.
        """
        if needs_own_kernel(func):  # grouped_mm (MoE experts): torch's meta function refuses fp32
            return grouped_mm_output(*args, **kwargs)
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
        known, value = self.known.read(func, args)
        if known:
            return value
        run = self.run_here()
        out = self._run(func, args, kwargs or {})
        self.known.follow(func, args, kwargs or {}, out)
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
        if self.cpu_kernels and (scratch := kernel_scratch_bytes(func, args, torch.get_num_threads())):
            # Allocated after the outputs (a backward's gradients are zeroed first) and freed before the op returns.
            self.transient(scratch, (self.phase, self.where(), f"{func.overloadpacket.__name__} scratch", (scratch,),
                                     torch.uint8))
        return out


def _allocator_segments() -> SegmentModel | None:
    """The segments of the allocator a CUDA step runs on: CUDA's caching allocator's, or under a simulated device its
    own (``simulate(segments=True)``), or none where its ledger keeps blocks only (reserved is allocated there)."""
    simulation = active_simulation()
    if simulation is None:
        return SegmentModel(expandable=expandable_segments(default=True), record=True)
    own = simulation.ledger.segments
    return SegmentModel(expandable=own.expandable, record=True) if isinstance(own, SegmentModel) else None
