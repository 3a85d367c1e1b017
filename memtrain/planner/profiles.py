"""Block profiles: a traced step cut into its segments (the code before the blocks, each block, the tail), and
the per-block figures of one block kind (bytes saved, peaks as envelopes of lines in the micro-batch, work done),
affine in the micro-batch from traces at micro-batches 1 and 2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from memtrain.errors import MemtrainError
from memtrain.estimate import Run, Trace
from memtrain.offload import MIN_BYTES_DEFAULT
from memtrain.planner.devices import DeviceProfile


# -- profiles: per-block figures from a few traces ------------------------------------------------------------
@dataclass
class _Work:
    """Work of a stretch of the step, affine in the micro-batch: value(b) = at1 + slope * (b - 1)."""

    matmul: tuple[float, float] = (0.0, 0.0)
    attention: tuple[float, float] = (0.0, 0.0)
    other: tuple[float, float] = (0.0, 0.0)
    ops: float = 0.0

    def on_share(self, share: float, every: _Work) -> _Work:
        """This work where all but ``every`` (work on every position: the last norm) runs on ``share`` of the
        positions, with the same ops: the chunked loss's head and logits on the labels it counts."""
        if share == 1:
            return self

        def mixed(whole: tuple[float, float], kept: tuple[float, float]) -> tuple[float, float]:
            return kept[0] + (whole[0] - kept[0]) * share, kept[1] + (whole[1] - kept[1]) * share

        return _Work(matmul=mixed(self.matmul, every.matmul), attention=mixed(self.attention, every.attention),
                     other=mixed(self.other, every.other), ops=self.ops)

    def seconds(self, b: int, tokens: int, device: DeviceProfile, compiled: bool) -> float:
        def at(pair: tuple[float, float]) -> float:
            return max(0.0, pair[0] + pair[1] * (b - 1))

        efficiency = tokens / (tokens + device.half_efficiency_tokens) if tokens > 0 else 1.0
        memory_bound = at(self.other) / device.memory_bandwidth
        overhead = self.ops * device.op_overhead_s
        if compiled:  # fused elementwise kernels and few launches (an assumption, stated in the plan)
            memory_bound, overhead = 0.5 * memory_bound, 0.1 * overhead
        work = at(self.matmul) / (device.matmul_flops * efficiency) + at(self.attention) / device.attention_flops
        work += memory_bound
        # A GPU runs while the host queues the next kernels: the slower of the two sets the pace. A CPU does both.
        return max(work, overhead) if device.asynchronous else work + overhead


def _affine(a: float, b: float) -> tuple[float, float]:
    return a, b - a


def _work(runs1: Sequence[Run], runs2: Sequence[Run]) -> _Work:
    def total(runs: Sequence[Run], attr: str) -> float:
        return float(sum(getattr(r, attr) for r in runs))

    return _Work(matmul=_affine(total(runs1, "matmul_flops"), total(runs2, "matmul_flops")),
                 attention=_affine(total(runs1, "attention_flops"), total(runs2, "attention_flops")),
                 other=_affine(total(runs1, "other_bytes"), total(runs2, "other_bytes")),
                 ops=total(runs1, "ops"))


@dataclass
class _Segments:
    """One trace cut into the model's parts: before the blocks, each block, the head and loss, after them."""

    pre_fwd: list[Run]
    block_fwd: list[list[Run]]
    tail_fwd: list[Run]
    tail_bwd: list[Run]
    block_bwd: list[list[Run]]
    post_bwd: list[Run]


def _without_gradient(bwd: list[Run], blocks: Sequence[str]) -> list[Run]:
    """``bwd`` with an empty backward run for each block that ran none: a block whose weights are all frozen,
    below every trainable one (LoRA on the output head only), gets no gradient, so autograd never enters it. Its
    backward then costs nothing and keeps nothing; it sits where it would have run, after the blocks above it."""
    ran = {r.label for r in bwd}
    missing = [name for name in reversed(blocks) if name not in ran]  # backward visits the last block first
    if not missing:
        return bwd
    at = max((i + 1 for i, r in enumerate(bwd) if r.label in blocks), default=len(bwd))
    alive = bwd[at - 1].end_bytes if at else 0
    empty = [Run(phase="backward", label=name, start_bytes=alive, peak_bytes=alive, end_bytes=alive,
                 curve=[alive], serials=[bwd[at - 1].peak_serial if at else 0]) for name in missing]
    return [*bwd[:at], *empty, *bwd[at:]]


def _segments(t: Trace) -> _Segments:
    names = {name: i for i, name in enumerate(t.blocks)}
    fwd = [r for r in t.runs if r.phase == "forward"]
    bwd = _without_gradient([r for r in t.runs if r.phase == "backward"], t.blocks)
    block_fwd: list[list[Run]] = [[] for _ in t.blocks]
    block_bwd: list[list[Run]] = [[] for _ in t.blocks]
    first = next(i for i, r in enumerate(fwd) if r.label in names)
    last = max(i for i, r in enumerate(fwd) if r.label in names)
    for r in fwd[first:last + 1]:
        if r.label in names:
            block_fwd[names[r.label]].append(r)
    bfirst = next(i for i, r in enumerate(bwd) if r.label in names)
    blast = max(i for i, r in enumerate(bwd) if r.label in names)
    for r in bwd[bfirst:blast + 1]:
        if r.label in names:
            block_bwd[names[r.label]].append(r)
    if any(not runs for runs in block_fwd) or any(not runs for runs in block_bwd):
        raise MemtrainError("plan: a block ran no forward or no backward in the traced step (is every block on the "
                            "path from the input to the loss?). To resolve this error, plan a model whose repeated "
                            "blocks all run, or choose the techniques yourself.")
    return _Segments(fwd[:first], block_fwd, fwd[last + 1:], bwd[:bfirst], block_bwd, bwd[blast + 1:])


class PeakEnvelope:
    """A peak as a function of the micro-batch ``b``: the upper envelope of lines ``a + slope * (b - 1)``, one
    per moment of a traced stretch (bytes alive there, at b = 1 and its growth per example)."""

    __slots__ = ("lines",)

    def __init__(self, lines: np.ndarray):
        self.lines = lines

    @classmethod
    def of(cls, at1: np.ndarray, at2: np.ndarray) -> PeakEnvelope:
        """Pairs two traced curves moment by moment and keeps the lines that are the highest for some b >= 1."""
        slope = at2 - at1
        order = np.lexsort((-slope, -at1))  # highest first, steepest first among equals
        keep, steepest = [], -math.inf
        for k in order:
            if slope[k] > steepest:
                keep.append(k)
                steepest = slope[k]
        return cls(np.stack([at1[keep], slope[keep]], axis=1))

    def at(self, b: int) -> float:
        return float(np.max(self.lines[:, 0] + self.lines[:, 1] * (b - 1)))


def _curve(runs: Sequence[Run], start: int, *, without_gradients: bool = False) -> np.ndarray:
    """Bytes alive at every moment of ``runs`` above ``start``; optionally less the gradients accumulated until
    then (where they would not stay: streamed to the host, or added into an earlier micro-batch's)."""
    if not runs:
        return np.zeros(1)
    values = np.concatenate([np.asarray(r.curve, dtype=np.float64) for r in runs]) - start
    if without_gradients:
        grads = sorted(g for r in runs for g in r.gradients)
        if grads:
            serials = np.concatenate([np.asarray(r.serials) for r in runs])
            cumulative = np.concatenate([[0.0], np.cumsum([n for _, n in grads])])
            # A gradient is let go just after it is accumulated: at its own allocation it is still there.
            values = values - cumulative[np.searchsorted([g for g, _ in grads], serials, side="left")]
    return values


def _lines(runs1: Sequence[Run], start1: int, runs2: Sequence[Run], start2: int, **kwargs: bool) -> PeakEnvelope:
    c1, c2 = _curve(runs1, start1, **kwargs), _curve(runs2, start2, **kwargs)
    if len(c1) != len(c2):  # the two traces took different paths: their peaks only
        c1, c2 = np.array([c1.max()]), np.array([c2.max()])
    return PeakEnvelope.of(c1, c2)


@dataclass
class KindProfile:
    """One block kind (keep, recompute, offload) in one trace pair, per block. Net figures are affine in the
    micro-batch, (L, 2) arrays of (at b = 1, per example); peaks are envelopes (see PeakEnvelope)."""

    saved: np.ndarray  # bytes a block's forward leaves alive
    released: np.ndarray  # bytes its forward cached that die when forward ends (weight casts)
    backward_net: np.ndarray  # bytes its backward leaves alive less what it found (gradients - saved)
    offloaded: np.ndarray  # bytes it could move to the host (and back): every storage, whatever its size
    backward_net_streamed: np.ndarray  # the same where gradients do not stay (streamed or accumulated)
    forward_excess: list[PeakEnvelope]  # its forward's peak above its start
    backward_excess: list[PeakEnvelope]  # its backward's peak above its start
    backward_excess_streamed: list[PeakEnvelope]
    fwd_work: list[_Work]
    bwd_work: list[_Work]
    # Per block, the storages it could move, (n, 2) of (bytes at b = 1, per example), or None where the two
    # traces moved different storages (then all of ``offloaded`` moves): see offloader_bytes.
    offloaded_tensors: list[np.ndarray | None] = field(default_factory=list)


def offloader_bytes(tensors: np.ndarray, b: int) -> float:
    """Bytes the activation offloader moves of these storages at micro-batch ``b``: those of at least its
    ``min_bytes`` (``memtrain.offload.MIN_BYTES_DEFAULT``, what ``apply_plan`` gives it) at that size. The traces
    record every storage it could move (``offload_min_bytes=0``): one under the threshold at the traced
    micro-batches 1 and 2 can be over it at the candidate's."""
    sizes = tensors[:, 0] + tensors[:, 1] * (b - 1)
    return float(sizes[sizes >= MIN_BYTES_DEFAULT].sum())


@dataclass
class TailProfile:
    """The model's code around the blocks for one loss (whole or chunked): nets affine, peaks envelopes."""

    pre: tuple[float, float]  # bytes alive at the first block's start above the fixed bytes
    tail_fwd_net: tuple[float, float]  # bytes alive when forward ends above the last block's end
    released_other: tuple[float, float]  # cast bytes of non-block code let go when forward ends
    tail_bwd_net: tuple[float, float]  # bytes alive when the last block's backward starts, above backward's start
    post_net: tuple[float, float]  # bytes alive when backward ends above the first block's backward end
    tail_bwd_net_streamed: tuple[float, float]
    post_net_streamed: tuple[float, float]
    tail_fwd_excess: PeakEnvelope  # the head and loss forward's peak above the last block's end
    tail_bwd_excess: PeakEnvelope  # the loss and head backward's peak above backward's start
    post_excess: PeakEnvelope  # after the blocks' backward (embeddings): the peak above its start
    tail_bwd_excess_streamed: PeakEnvelope
    post_excess_streamed: PeakEnvelope
    # Where the first block offloads its input: a model may hold that input (its embeddings) until its forward
    # returns, so those bytes leave in the head's stretch. (None until filled in by profiles_from_traces.)
    tail_fwd_net_offloaded: tuple[float, float] | None
    tail_fwd_excess_offloaded: PeakEnvelope | None
    pre_work: _Work
    tail_fwd_work: _Work
    tail_bwd_work: _Work
    post_work: _Work
    # Of the tail's work, what runs on every position, before the head (the last norm; ``_every_position``)
    tail_fwd_every: _Work
    tail_bwd_every: _Work


def _pair(x1: float, x2: float) -> tuple[float, float]:
    return float(x1), float(x2 - x1)


def kind_profile(t1: Trace, t2: Trace) -> KindProfile:
    s1, s2 = _segments(t1), _segments(t2)
    nets: list[list[tuple[float, float]]] = [[] for _ in range(5)]
    fexcess, bexcess, bexcess_streamed = [], [], []
    for f1, f2, b1, b2 in zip(s1.block_fwd, s2.block_fwd, s1.block_bwd, s2.block_bwd, strict=True):
        def net(runs: Sequence[Run]) -> tuple[float, ...]:
            fstart, bstart = runs[0].start_bytes, runs[2].start_bytes
            grads = sum(r.gradient_bytes for r in runs[3])
            bnet = runs[3][-1].end_bytes - bstart
            return (runs[1][-1].end_bytes - fstart, sum(r.released_bytes for r in runs[1]), bnet,
                    sum(r.offloaded_bytes for r in runs[1]), bnet - grads)

        one = net((f1[0], f1, b1[0], b1))
        two = net((f2[0], f2, b2[0], b2))
        for column, x, y in zip(nets, one, two, strict=True):
            column.append(_pair(x, y))
        fexcess.append(_lines(f1, f1[0].start_bytes, f2, f2[0].start_bytes))
        bexcess.append(_lines(b1, b1[0].start_bytes, b2, b2[0].start_bytes))
        bexcess_streamed.append(_lines(b1, b1[0].start_bytes, b2, b2[0].start_bytes, without_gradients=True))
    arrays = [np.array(c, dtype=np.float64) for c in nets]
    tensors: list[np.ndarray | None] = []
    for f1, f2 in zip(s1.block_fwd, s2.block_fwd, strict=True):
        one = np.array([n for r in f1 for n in r.offloaded_sizes], dtype=np.float64)
        two = np.array([n for r in f2 for n in r.offloaded_sizes], dtype=np.float64)
        tensors.append(np.stack([one, two - one], axis=1) if len(one) == len(two) else None)
    return KindProfile(*arrays, forward_excess=fexcess, backward_excess=bexcess,
                        backward_excess_streamed=bexcess_streamed,
                        fwd_work=[_work(a, b) for a, b in zip(s1.block_fwd, s2.block_fwd, strict=True)],
                        bwd_work=[_work(a, b) for a, b in zip(s1.block_bwd, s2.block_bwd, strict=True)],
                        offloaded_tensors=tensors)


def _tail_nets(t: Trace, s: _Segments) -> tuple[float, ...]:
    last_end = s.block_fwd[-1][-1].end_bytes
    backward_start = (s.tail_bwd or s.block_bwd[-1])[0].start_bytes
    bwd_end = s.block_bwd[0][-1].end_bytes
    tail_net = s.block_bwd[-1][0].start_bytes - backward_start
    post_net = dict(t.report.phase_bytes)["backward"] - bwd_end
    return (s.block_fwd[0][0].start_bytes - t.fixed_bytes, t.forward_end_bytes - last_end,
            sum(r.released_bytes for r in (*s.pre_fwd, *s.tail_fwd)), tail_net, post_net,
            tail_net - sum(r.gradient_bytes for r in s.tail_bwd), post_net - sum(r.gradient_bytes for r in s.post_bwd))


def tail_profile(t1: Trace, t2: Trace) -> TailProfile:
    s1, s2 = _segments(t1), _segments(t2)

    def starts(s: _Segments) -> tuple[int, int, int]:
        return (s.block_fwd[-1][-1].end_bytes, (s.tail_bwd or s.block_bwd[-1])[0].start_bytes,
                s.block_bwd[0][-1].end_bytes)

    (last1, bwd1, end1), (last2, bwd2, end2) = starts(s1), starts(s2)
    return TailProfile(
        *(_pair(x, y) for x, y in zip(_tail_nets(t1, s1), _tail_nets(t2, s2), strict=True)),
        tail_fwd_excess=_lines(s1.tail_fwd, last1, s2.tail_fwd, last2),
        tail_bwd_excess=_lines(s1.tail_bwd, bwd1, s2.tail_bwd, bwd2),
        post_excess=_lines(s1.post_bwd, end1, s2.post_bwd, end2),
        tail_bwd_excess_streamed=_lines(s1.tail_bwd, bwd1, s2.tail_bwd, bwd2, without_gradients=True),
        post_excess_streamed=_lines(s1.post_bwd, end1, s2.post_bwd, end2, without_gradients=True),
        tail_fwd_net_offloaded=None, tail_fwd_excess_offloaded=None,
        pre_work=_work(s1.pre_fwd, s2.pre_fwd), tail_fwd_work=_work(s1.tail_fwd, s2.tail_fwd),
        tail_bwd_work=_work(s1.tail_bwd, s2.tail_bwd), post_work=_work(s1.post_bwd, s2.post_bwd),
        tail_fwd_every=_work(*(_every_position(s)[0] for s in (s1, s2))),
        tail_bwd_every=_work(*(_every_position(s)[1] for s in (s1, s2))))


def _every_position(s: _Segments) -> tuple[list[Run], list[Run]]:
    """The tail's runs (forward, backward) that run on every position: those of the model's modules before the
    head (the first run that multiplies), e.g. the last norm, and their backward. The head and the loss after them
    run on the positions the chunked loss keeps."""
    head = next((i for i, r in enumerate(s.tail_fwd) if r.matmul_flops > 0), 0)  # none: every run is the loss's
    before = {r.label for r in s.tail_fwd[:head]} - {r.label for r in s.tail_fwd[head:]}
    return [r for r in s.tail_fwd[:head] if r.label in before], [r for r in s.tail_bwd if r.label in before]


@dataclass
class Profiles:
    """Everything composition needs, for one weights dtype."""

    kinds: dict[str, KindProfile]  # "keep", "full", "selective", "offload-inputs", "offload"; each "+tiled" too
    tails: dict[bool, TailProfile]  # chunked loss or not
    fixed_bytes: int  # the traced fixed bytes (parameters, buffers, inputs at b=1, AdamW state, workspaces)
    input_bytes: tuple[float, float]  # the batch's own bytes, affine in b
    parameter_bytes: int  # in the traced dtype (bf16 where the device weights are)
    trainable_bytes: int  # the same for the parameters that get gradients (their gradients' bytes too)
    trainable_numel: int
    block_parameter_bytes: np.ndarray  # (L,) the trainable parameters'
    gathered_bytes: np.ndarray  # (L + 1, 2): each block's parameters, then the root's, as traced and in 2-byte floats
    replicated_bytes: int  # the 4-bit layers' quantisation state, which no FSDP2 group shards or gathers
    adamw_state_bytes: int
    traces: int
    trainable_params: list[tuple[int, torch.dtype]] = field(default_factory=list)  # registration order
    # Every parameter FSDP2 shards (not a 4-bit layer's quantisation state): (numel, dtype as traced, trainable)
    sharded_params: list[tuple[int, torch.dtype, bool]] = field(default_factory=list)
    trainable_shapes: list[tuple[int, ...]] = field(default_factory=list)  # the same parameters' shapes
    trainable_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # -1: no block
    # Figures derived from these alone, computed once (the cost model's, e.g. the offloaded parameters' bytes)
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)


def affine_at(pair: Sequence[float] | np.ndarray, b: int) -> Any:
    if isinstance(pair, np.ndarray) and pair.ndim == 2:
        return pair[:, 0] + pair[:, 1] * (b - 1)
    return pair[0] + pair[1] * (b - 1)
