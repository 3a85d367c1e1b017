"""The cost model: a candidate's peak, host bytes and step time composed from the block profiles (``Composer``),
the optimizer step, the host link and its stall, DDP/FSDP2 communication and memory; ``CandidateTable`` holds every
composed candidate as columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memtrain.estimate import Trace
from memtrain.offload import PREFETCH_DEFAULT, SLAB_BYTES_DEFAULT
from memtrain.optim import offloaded_mask, optimizer_memory
from memtrain.planner.devices import DeviceProfile
from memtrain.planner.profiles import Profiles, affine_at, offloader_bytes
from memtrain.planner.settings import Configuration, HostLink, PlanSettings, Problem, configuration_of
from memtrain.techniques.optimizer import NamedOptimizer

_BUCKET_BYTES = 4 * (1 << 25)  # CPUOffloadOptimizer.bucket_numel fp32 parameters: the last bucket's copy back
# The data loader's share of host RAM, an allowance: the batch being copied to the device and the next one
# (DevicePrefetcher), each of int64 token rows (inputs and labels; position ids too when packed) pinned in torch's
# host cache, which rounds every block up to a power of two. The dataset's own pages (memory-mapped) are the OS's.
LOADER_BATCHES = 2
WEIGHTS_IN_FLIGHT = 1 + PREFETCH_DEFAULT  # parameter offload: the block in use and the one copying ahead of it


def host_pool_bytes(offloaded: np.ndarray) -> np.ndarray:
    """The activation offloader's pinned pool for ``offloaded`` bytes a micro-batch: whole slabs, as ``HostPool``
    pins them (``SLAB_BYTES_DEFAULT`` each, the size ``apply_plan``'s offloader takes on a machine with 256 MiB or
    more free)."""
    return np.ceil(offloaded / SLAB_BYTES_DEFAULT) * SLAB_BYTES_DEFAULT


def loader_host_bytes(ctx: Problem, micro_batch_size: int) -> int:
    """The data loader's pinned batches (``LOADER_BATCHES``) for a CUDA run; none on the CPU (nothing is pinned)."""
    if ctx.device != "cuda":
        return 0
    tensor = micro_batch_size * ctx.seq_len * 8
    return LOADER_BATCHES * (3 if ctx.packed else 2) * (1 << max(tensor - 1, 1).bit_length())


@dataclass(frozen=True)
class _KindArrays:
    """One block kind's per-block figures at one micro-batch (bytes, seconds)."""

    saved: np.ndarray
    forward_excess: np.ndarray
    released: np.ndarray
    backward_excess: np.ndarray
    backward_net: np.ndarray
    offloaded: np.ndarray
    backward_excess_streamed: np.ndarray
    backward_net_streamed: np.ndarray
    forward_s: np.ndarray
    backward_s: np.ndarray


class Composer:
    """Composes candidates from the profiles: for one configuration and one count of offloaded blocks, every count
    of recomputed blocks at once (numpy over the rows)."""

    _FIELDS = ("saved", "forward_excess", "released", "backward_excess", "backward_net", "offloaded",
               "backward_excess_streamed", "backward_net_streamed")

    def __init__(self, ctx: Problem, profiles: dict[Any, Profiles]):
        self.ctx = ctx
        self.profiles = profiles
        self._cache: dict[tuple[Any, ...], _KindArrays] = {}
        self._optimizers: dict[tuple[Any, ...], tuple[Any, np.ndarray, bool]] = {}

    def optimizer(self, prof: Profiles, cfg: Configuration) -> tuple[Any, np.ndarray, bool]:
        """The optimizer's bytes (``memtrain.optim.optimizer_memory``), which blocks' gradients leave the device
        as they land (streamed to the host, or stepped in backward), and whether the head's and embeddings' do."""
        key = (id(prof), cfg.state_precision, cfg.host_fraction, cfg.step_in_backward, cfg.accumulation,
               cfg.pure_bf16, cfg.optimizer_class)
        if key not in self._optimizers:
            memory = optimizer_memory(prof.trainable_params, state_precision=cfg.state_precision,
                                      offload_fraction=cfg.host_fraction, step_in_backward=cfg.step_in_backward,
                                      accumulation_steps=cfg.accumulation, device_type=self.ctx.device,
                                      pure_bf16=cfg.pure_bf16, named=cfg.optimizer_class,
                                      shapes=prof.trainable_shapes, round_to=512 if self.ctx.device == "cuda" else 1)
            leaving = np.array(offloaded_mask([n for n, _ in prof.trainable_params], cfg.host_fraction), dtype=bool)
            if cfg.step_in_backward and cfg.accumulation == 1:
                leaving[:] = True
            blocks = prof.trainable_blocks
            n = len(self.ctx.block_names)
            # A block's gradients leave when all of its parameters' do (a block split by a partial offload stays).
            in_block = blocks >= 0
            counts = np.bincount(blocks[in_block], minlength=n)
            block_leaves = (counts > 0) & (np.bincount(blocks[in_block & leaving], minlength=n) == counts)
            other = blocks < 0
            self._optimizers[key] = (memory, block_leaves, bool(other.any() and leaving[other].all()))
        return self._optimizers[key]

    def profile(self, optimizer: str, pure_bf16: bool = False) -> Profiles:
        """The profiles of the device weights' dtype: bf16 with an offloaded fp32 master, or pure bf16."""
        return self.profiles["bf16" if optimizer == "offload-bf16-weights" or pure_bf16 else None]

    def arrays(self, prof: Profiles, kind: str, b: int, compiled: bool) -> _KindArrays:
        key = (id(prof), kind, b, compiled)
        if key not in self._cache:
            kp = prof.kinds[kind]
            tokens = b * self.ctx.seq_len
            dev = self.ctx.device_profile.for_precision(self.ctx.precision)

            def value(name: str) -> np.ndarray:
                field_ = getattr(kp, name)
                return np.array([x.at(b) for x in field_]) if isinstance(field_, list) else affine_at(field_, b)

            values = {name: value(name) for name in self._FIELDS}
            if kp.offloaded_tensors:
                # What the offloader leaves on the device (under its threshold at this micro-batch) stays saved
                # until the block's backward frees it.
                moved = np.array([offloader_bytes(t, b) if t is not None else float(all_)
                                  for t, all_ in zip(kp.offloaded_tensors, values["offloaded"], strict=True)])
                stays = values["offloaded"] - moved
                values["offloaded"] = moved
                values["saved"] = values["saved"] + stays
                values["backward_net"] = values["backward_net"] - stays
                values["backward_net_streamed"] = values["backward_net_streamed"] - stays
            self._cache[key] = _KindArrays(
                **values,
                forward_s=np.array([w.seconds(b, tokens, dev, compiled) for w in kp.fwd_work]),
                backward_s=np.array([w.seconds(b, tokens, dev, compiled) for w in kp.bwd_work]),
            )
        return self._cache[key]

    def rows(self, cfg: Configuration, offload: int | np.ndarray, recompute: np.ndarray) -> tuple[np.ndarray, ...]:
        """(peak, host, seconds) per row, row k offloading the first ``offload`` (or ``offload[k]``) blocks and
        recomputing the ``recompute[k]`` after them: every layout of one configuration in one pass over the blocks
        (each row's figures are its own, whichever rows come with it)."""
        i = np.arange(len(self.ctx.block_names))[None, :]
        first = np.broadcast_to(np.asarray(offload), recompute.shape)[:, None]
        return self.assigned(cfg, i < first, (i >= first) & (i < first + recompute[:, None]))

    def picker(self, cfg: Configuration, is_off: np.ndarray, is_rec: np.ndarray) -> Callable[[str], np.ndarray]:
        """A (rows, blocks) array of one ``_KindArrays`` field per assignment row: the offloaded kind's where
        ``is_off``, the recomputed kind's where ``is_rec``, the kept kind's elsewhere."""
        b, prof = cfg.micro_batch_size, self.profile(cfg.optimizer, cfg.pure_bf16)
        # Blocks compiled one by one run their own code compiled whatever the set-up (see compile_model).
        keep = self.arrays(prof, "keep", b, cfg.compile)
        rec = self.arrays(prof, cfg.flavor, b, cfg.compile) if is_rec.any() else keep
        off = self.arrays(prof, "offload", b, cfg.compile) if is_off.any() else keep

        def pick(name: str) -> np.ndarray:
            return np.where(is_off, getattr(off, name), np.where(is_rec, getattr(rec, name), getattr(keep, name)))

        return pick

    def offloaded(self, cfg: Configuration, pick: Callable[[str], np.ndarray]) -> np.ndarray:
        """Bytes each block moves to the host (and back) in one micro-batch, (rows, blocks): none on a CPU."""
        offloaded = pick("offloaded")
        return offloaded if self.ctx.device == "cuda" else np.zeros_like(offloaded)

    def host_link(self, s: PlanSettings) -> HostLink:
        """Bytes over the host link in one optimizer step of ``s`` (per rank): the figures the time model's
        ``_offload_stall`` and ``_optimizer_seconds`` take."""
        cfg = configuration_of(s)
        kinds = np.array(s.blocks)[None, :]
        activations = float(self.offloaded(cfg, self.picker(cfg, kinds == "offload", kinds == "recompute")).sum())
        prof = self.profile(cfg.optimizer, cfg.pure_bf16)
        gradients, weights = _optimizer_link(self.ctx, prof, cfg)
        streamed = streamed_weight_bytes(prof, cfg)
        return HostLink(round(activations * cfg.accumulation), round(activations * cfg.accumulation),
                        round(gradients * cfg.accumulation), round(weights - streamed),
                        round(2 * streamed * cfg.accumulation))

    def compose(self, jobs: Sequence[tuple[Configuration, np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, ...]]:
        """``rows`` of each job (a configuration, its layouts' offloaded and recomputed counts), layout by layout:
        the configurations of one weights dtype, micro-batch, recompute flavor and compile (most differ only in
        the optimizer) share a ``Layout``, so its blocks' figures are picked and summed once."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for k, (cfg, offload, recompute) in enumerate(jobs):
            key = (id(self.profile(cfg.optimizer, cfg.pure_bf16)), cfg.micro_batch_size, cfg.compile, cfg.flavor,
                   offload.tobytes(), recompute.tobytes())
            groups.setdefault(key, []).append(k)
        out: list[tuple[np.ndarray, ...]] = [()] * len(jobs)
        i = np.arange(len(self.ctx.block_names))[None, :]
        for members in groups.values():  # one layout's arrays alive at a time: the 70B's are megabytes each
            cfg, offload, recompute = jobs[members[0]]
            is_off = i < offload[:, None]
            is_rec = (i >= offload[:, None]) & (i < offload[:, None] + recompute[:, None])
            layout = Layout(self.picker(cfg, is_off, is_rec), is_off, is_rec)
            for k in members:
                out[k] = self.assigned(jobs[k][0], is_off, is_rec, layout)
        return out

    def assigned(self, cfg: Configuration, is_off: np.ndarray, is_rec: np.ndarray,
                 layout: Layout | None = None) -> tuple[np.ndarray, ...]:
        """(peak, host, seconds) per row of a (rows, blocks) assignment: offloaded where ``is_off``, recomputed
        where ``is_rec``, kept elsewhere (``layout``: its figures, shared with other configurations)."""
        ctx, b = self.ctx, cfg.micro_batch_size
        prof = self.profile(cfg.optimizer, cfg.pure_bf16)
        layout = layout if layout is not None else Layout(self.picker(cfg, is_off, is_rec), is_off, is_rec)
        memory = self.optimizer(prof, cfg)[0]
        peak = self._peak(cfg, prof, layout)
        # -- host bytes (one node: every rank's share)
        offloaded = layout.memo("offloaded over the link", lambda: self.offloaded(cfg, layout))
        moved = layout.memo(("total", "offloaded over the link"), lambda: offloaded.sum(axis=1))
        host = (host_pool_bytes(moved) + memory.host_bytes + loader_host_bytes(ctx, b)
                + _weights_host_bytes(prof, cfg)) * ranks_per_node(ctx.world)
        return peak, host, self._seconds(cfg, prof, layout, offloaded, moved)

    def _peak(self, cfg: Configuration, prof: Profiles, layout: Layout) -> np.ndarray:
        """The device's peak per row: forward block by block, the head and loss, backward from the last block to
        the first, then the step; one process (distributed ranks differ by ``_distributed_shift``)."""
        ctx, b = self.ctx, cfg.micro_batch_size
        tail = prof.tails[cfg.chunked_loss]
        memory, block_leaves, other_leaves = self.optimizer(prof, cfg)
        # A gradient that leaves the device as it lands (to the host, or stepped in backward), or is added into an
        # earlier micro-batch's and freed, does not stay: the "_streamed" figures.
        transient = block_leaves | (cfg.accumulation > 1)
        suffix = "_streamed" if (other_leaves or cfg.accumulation > 1) else ""
        saved, fexcess = layout("saved"), layout("forward_excess")
        bexcess, bnet, later = layout.backward(transient)
        fixed = (float(prof.fixed_bytes) + affine_at(prof.input_bytes, b) - prof.input_bytes[0] - prof.adamw_state_bytes
                 + memory.device_state_bytes)
        if cfg.accumulation > 1:
            fixed += memory.device_gradient_bytes  # the earlier micro-batches' gradients, alive from the start

        start = fixed + affine_at(tail.pre, b)
        cumulative = layout.memo("cumulative saved", lambda: np.cumsum(saved, axis=1))
        peak = layout.memo(("forward peak", start), lambda: np.max(start + cumulative - saved + fexcess, axis=1))
        tail_start = start + layout.total("saved")
        # Whether the first block sends its input to the host (see TailProfile.tail_fwd_net_offloaded).
        first_out = layout.is_off[:, 0] | (layout.is_rec[:, 0] & (cfg.flavor == "offload-inputs"))
        tail_excess = np.where(first_out, tail.tail_fwd_excess_offloaded.at(b), tail.tail_fwd_excess.at(b))
        tail_net = np.where(first_out, affine_at(tail.tail_fwd_net_offloaded, b), affine_at(tail.tail_fwd_net, b))
        peak = np.maximum(peak, tail_start + tail_excess)
        backward_start = tail_start + tail_net - affine_at(tail.released_other, b) - layout.total("released")
        peak = np.maximum(peak, backward_start + getattr(tail, "tail_bwd_excess" + suffix).at(b))
        first_block = backward_start + affine_at(getattr(tail, "tail_bwd_net" + suffix), b)
        # Stepping in backward, the step's temporaries come during backward (an upper bound: at its peak).
        in_backward = memory.device_step_temp_bytes if cfg.step_in_backward else 0
        # FSDP2 frees the share of each gradient that other ranks own as it lands: at block i's backward the
        # gradients of the blocks after it (a lower bound: the head's are not counted before the end).
        sharded = gradient_shard(ctx, cfg)
        grads = np.asarray(prof.block_parameter_bytes, dtype=float)
        landed = sharded * (np.cumsum(grads[::-1])[::-1] - grads)
        blocks_peak = layout.memo(("backward peak", transient.tobytes(), first_block.tobytes(), landed.tobytes()),
                                  lambda: np.max(first_block[:, None] + later + bexcess - landed[None, :], axis=1))
        peak = np.maximum(peak, blocks_peak + in_backward)
        end_blocks = first_block + layout.memo(("total", "backward net", transient.tobytes()),
                                               lambda: bnet.sum(axis=1))
        peak = np.maximum(peak, end_blocks + getattr(tail, "post_excess" + suffix).at(b) - sharded * grads.sum())
        after = end_blocks + affine_at(getattr(tail, "post_net" + suffix), b)
        peak = np.maximum(peak, after + (0 if cfg.step_in_backward else memory.device_step_temp_bytes)
                          - sharded * float(prof.trainable_bytes))
        return peak + _distributed_shift(ctx, prof, cfg) + weights_shift(prof, cfg)

    def _seconds(self, cfg: Configuration, prof: Profiles, layout: Layout, offloaded: np.ndarray,
                 moved: np.ndarray) -> np.ndarray:
        """A step's seconds per row: the micro-batches (the blocks, the head, the waits for the host link), the
        optimizer step and the communication."""
        ctx, b = self.ctx, cfg.micro_batch_size
        tail = prof.tails[cfg.chunked_loss]
        fwd, bwd = layout("forward_s"), layout("backward_s")
        dev = ctx.device_profile.for_precision(ctx.precision)  # a CPU's matmuls at its 16-bit rate under autocast
        tokens = b * ctx.seq_len
        # compile_model compiles block by block where an offloader's hooks must stay outside the compiled regions:
        # the embeddings, the last norm, the head and the loss then run eagerly.
        def rest(compiled: bool) -> float:
            return sum(w.seconds(b, tokens, dev, compiled)
                       for w in (tail.pre_work, tail.tail_fwd_work, tail.tail_bwd_work, tail.post_work))

        per_block = layout.memo("compiled per block", lambda: _compiled_per_block(cfg, layout.is_off, layout.is_rec))
        head = np.where(per_block, rest(False), rest(cfg.compile))
        micro = layout.total("forward_s") + layout.total("backward_s") + head
        if ctx.device == "cuda" and layout.memo("moves", lambda: bool(offloaded.any())):
            micro = micro + layout.memo("offload stall", lambda: _offload_stall(fwd, bwd, offloaded, dev))
        if cfg.offload_weights:
            micro = micro + layout.memo("weights stall", lambda: _weights_stall(ctx, prof, fwd, bwd))
            if ctx.device == "cuda":
                # The stalls above are modelled one stream of copies at a time; together they share the link, so
                # a micro-batch lasts at least as long as its bytes take over it, each direction.
                streamed = 2 * streamed_weight_bytes(prof, cfg)
                grads = _optimizer_link(ctx, prof, cfg)[0]
                micro = np.maximum(micro, np.maximum((moved + streamed) / dev.host_to_device,
                                                     (moved + grads) / dev.device_to_host))
        backward = layout.total("backward_s")
        seconds = (micro * cfg.accumulation + _optimizer_seconds(ctx, prof, cfg, backward)
                   + _communication_seconds(ctx, prof, cfg, backward + layout.total("forward_s")))
        if cfg.step_in_backward:
            # One backward pass (clipping by the previous window's norm, the fp16 inf check on the device), its
            # steps in _optimizer_seconds like the ordinary step's; on top, per tensor: its gradient's norm read in
            # the hook, the inf flag, the clip multiply and an optimizer call of its own (a few small ops each). So
            # it is never faster than the ordinary step: the search takes it for the memory it saves.
            tensors = len(prof.trainable_params)
            seconds = seconds + (tensors * _IN_BACKWARD_OPS * dev.op_overhead_s
                                 + 4.0 * prof.trainable_numel / dev.memory_bandwidth)
        return seconds


class Layout:
    """Rows of block layouts (offloaded where ``is_off``, recomputed where ``is_rec``, kept elsewhere) at one
    weights dtype, micro-batch, recompute flavor and compile: their blocks' figures, (rows, blocks) arrays, and what
    is computed from them alone, each computed once for every configuration that shares the layout (``memo``).
    Each row's figures are computed as they would be alone, so sharing changes no figure."""

    def __init__(self, pick: Callable[[str], np.ndarray], is_off: np.ndarray, is_rec: np.ndarray):
        self.is_off, self.is_rec = is_off, is_rec
        self._pick = pick
        self._memo: dict[Any, Any] = {}

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed the first time ``key`` is asked for."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def __call__(self, name: str) -> np.ndarray:
        """One ``_KindArrays`` field per block of each row, (rows, blocks)."""
        return self.memo(name, lambda: self._pick(name))

    def total(self, name: str) -> np.ndarray:
        """A field summed over the blocks, per row."""
        return self.memo(("total", name), lambda: self(name).sum(axis=1))

    def backward(self, transient: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(backward peak above its start, backward net, what the blocks after each one left), (rows, blocks),
        with the "_streamed" figures for the blocks whose gradients do not stay (``transient``)."""
        def make() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            bexcess = np.where(transient, self("backward_excess_streamed"), self("backward_excess"))
            bnet = np.where(transient, self("backward_net_streamed"), self("backward_net"))
            return bexcess, bnet, np.cumsum(bnet[:, ::-1], axis=1)[:, ::-1] - bnet

        return self.memo(("backward", transient.tobytes()), make)


def streamed_weight_bytes(prof: Profiles, cfg: Configuration | PlanSettings) -> float:
    """Bytes of the blocks' weights (the device dtype) that parameter offload keeps in host RAM; 0 without it."""
    return float(np.sum(prof.block_parameter_bytes)) if cfg.offload_weights else 0.0


def weights_shift(prof: Profiles, cfg: Configuration | PlanSettings) -> float:
    """What parameter offload changes at every moment of the step, on the device: the blocks' weights are gone but
    for ``WEIGHTS_IN_FLIGHT`` of the largest (the block in use and the next one copying; their gradients are the
    offloaded optimizer's, streamed to the host as they land, which the trace already counts)."""
    if not cfg.offload_weights:
        return 0.0
    return WEIGHTS_IN_FLIGHT * float(np.max(prof.block_parameter_bytes)) - streamed_weight_bytes(prof, cfg)


def _weights_host_bytes(prof: Profiles, cfg: Configuration) -> float:
    """Host RAM parameter offload adds: nothing where the weights stream from the fp32 master itself; beside a bf16
    cast, a gradient stage of their own (``CPUOffloadOptimizer.stream_weights``), 2 bytes a block parameter."""
    return streamed_weight_bytes(prof, cfg) if cfg.optimizer == "offload-bf16-weights" else 0.0


def _weights_stall(ctx: Problem, prof: Profiles, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """Seconds a micro-batch waits for block weights under parameter offload, per row (``WeightStreamer``, one block
    ahead). On CUDA the copies run on a side stream: block i+1's during block i's forward, block i-1's during block
    i's backward, so only the first block's copy (forward) and the last one's (backward: its copy starts at its own
    pre-backward hook) and a copy that outlasts the compute beside it are waited for. On a CPU the "copies" are
    memcpys on the compute thread, all waited for."""
    dev = ctx.device_profile
    blocks = np.asarray(prof.block_parameter_bytes, dtype=float)
    if ctx.device != "cuda":
        return np.full(fwd.shape[0], 2 * 2 * blocks.sum() / dev.memory_bandwidth)  # read and write, twice a pass
    copy = blocks / dev.host_to_device
    forward = copy[0] + np.maximum(0.0, copy[None, 1:] - fwd[:, :-1]).sum(axis=1)
    backward = copy[-1] + np.maximum(0.0, copy[None, :-1] - bwd[:, 1:]).sum(axis=1)
    return forward + backward


def _compiled_per_block(cfg: Configuration, is_off: np.ndarray, is_rec: np.ndarray) -> np.ndarray:
    """Per row: whether ``compile_model`` compiles this set-up block by block (compiled, with a block that
    offloads its activations or its saved input), leaving the code between the blocks eager."""
    offloads = is_off.any(axis=1) | (is_rec.any(axis=1) & (cfg.flavor == "offload-inputs"))
    return offloads & cfg.compile


_IN_BACKWARD_OPS = 4  # extra small ops per parameter tensor of step-in-backward's hooks


def _offload_stall(fwd: np.ndarray, bwd: np.ndarray, offloaded: np.ndarray, dev: DeviceProfile) -> np.ndarray:
    """Seconds backward waits for activations coming back, per row. Each block's copies leave when its forward
    ends and queue on the link (device -> host); in backward a block's tensors come back while it computes (two
    tensors ahead of use, so hardly earlier), on the other direction of the link, after their own copy out."""
    rows, L = fwd.shape
    t, link = np.zeros(rows), np.zeros(rows)
    out_done = np.zeros((rows, L))
    for i in range(L):
        t = t + fwd[:, i]
        moving = offloaded[:, i] > 0
        link = np.where(moving, np.maximum(link, t) + offloaded[:, i] / dev.device_to_host, link)
        out_done[:, i] = link
    clock, link, stall = t, np.zeros(rows), np.zeros(rows)
    for i in reversed(range(L)):
        moving = offloaded[:, i] > 0
        begin = np.maximum(np.maximum(clock, out_done[:, i]), link)
        back = begin + offloaded[:, i] / dev.host_to_device
        finish = np.maximum(clock + bwd[:, i], back)
        stall = stall + np.where(moving, finish - clock - bwd[:, i], 0.0)
        link = np.where(moving, back, link)
        clock = np.where(moving, finish, clock + bwd[:, i])
    return stall


def ranks_per_node(world: int) -> int:
    """Ranks sharing one host's RAM: this machine's GPUs, or an 8-GPU node."""
    local = torch.accelerator.device_count() if torch.accelerator.is_available() else 8
    return max(1, min(world, local))


# Bytes a device AdamW step reads and writes per parameter, by moment precision: fused fp32 AdamW reads p, g,
# m, v and writes p, m, v (28); BF16StateAdamW runs it on fp32 copies of the moments, copied in, rounded with
# noise and copied back a pass at a time (92: its docstring counts them); bitsandbytes' 8-bit step moves 2 bytes of
# each moment and a scale per 256. (Assumptions; the CPU uses measured rates.)
_STEP_BYTES = {"fp32": 28.0, "bf16": 92.0, "int8": 20.0}
# Kernel launches per parameter tensor: fused AdamW steps every tensor in a few multi-tensor launches;
# BF16StateAdamW one step-counter add, then 5 multi-tensor ops a pass of 2**24 elements (bench_optim_ops.py
# prints them): the 1.1B Llama's 201 tensors take 66 passes, 331 ops, about 1.6 a tensor; bitsandbytes steps per
# tensor.
_STEP_OPS = {"fp32": 0.05, "bf16": 2.0, "int8": 2.0}
# How much faster (a fraction of the step) lean moments must be than fp32 ones to be chosen for speed alone.
LEAN_MARGIN = 0.05
# A host step's rate relative to torch's fused fp32 AdamW's, where the probe did not measure it (a --gpu plan's host):
# the fused host kernels (memtrain.optim.host_kernels) side by side with it on 2 threads, 96M parameters (beyond the
# L3 cache, as a model's host step is): `memtrain bench host_step -- --params 96M` printed, in three runs, bf16 moments
# 1.22x, 1.23x and 1.24x, pure bf16 1.43x, 1.45x and 1.33x with bf16 moments, 1.14x and 1.18x with fp32 ones, and
# bitsandbytes' 8-bit layout 0.93x (its encoding through 64-bit table entries; 0.79x and 0.81x before it).
_CPU_RATE = {"fp32": 1.0, "bf16": 1.22, "int8": 0.93}
_PURE_CPU_RATE = {"fp32": 1.14, "bf16": 1.44}
# Pure bf16 (PureBF16AdamW) on a device (its multi-tensor path): per parameter, the bf16 weight and gradient copied
# into fp32 (read 4, write 8), the moments too where they are bf16 (4, 8), the fused kernel on the fp32 copies (28),
# the rounding noise added to the weight and bf16 moments (read 12 + 12, write 12 with bf16 moments; a third
# without), the mask (24 or 8) and the copies back (12 + 6, or 4 + 2): about 136 bytes with bf16 moments, 76 with
# fp32 ones (fp32 moments are stepped in place).
_PURE_STEP_BYTES = {"fp32": 76.0, "bf16": 136.0}


# A named class on the device (an assumption: no kernel of its own is measured there): it reads the weight and the
# gradient, writes the weight, and reads and writes its state once; multi-tensor kernels, a few launches a tensor.
_NAMED_STEP_OPS = 0.2


def _named_step_bytes(prof: Profiles, named: NamedOptimizer) -> float:
    """Bytes a named class's device step moves per parameter: weight and gradient read, weight written (fp32), and
    its measured state read and written."""
    key = ("named step bytes", named)
    if key not in prof.memo:
        state = sum(named.state_bytes(shape, dt) for shape, (_, dt) in zip(prof.trainable_shapes,
                                                                          prof.trainable_params, strict=True))
        prof.memo[key] = 12.0 + 2 * state / max(prof.trainable_numel, 1)
    return prof.memo[key]


def named_state_bytes(prof: Profiles, named: NamedOptimizer, round_to: int) -> float:
    """A named class's device state over every trainable parameter (the probe's, rounded as the allocator does)."""
    key = ("named state bytes", named, round_to)
    if key not in prof.memo:
        prof.memo[key] = float(sum(named.state_bytes(shape, dt, round_to) for shape, (_, dt) in zip(
            prof.trainable_shapes, prof.trainable_params, strict=True)))
    return prof.memo[key]


def host_step_rate(dev: DeviceProfile, cfg: Configuration) -> float:
    """Parameters per second of the host's AdamW step with ``cfg``'s moments: the probe's measured rate where it
    has one, else fused fp32 AdamW's rate scaled by the measured ratio (``_CPU_RATE``, ``_PURE_CPU_RATE``)."""
    if not cfg.optimizer_class.is_adamw:  # another class: fused AdamW's rate over its measured time ratio
        return dev.cpu_adamw / cfg.optimizer_class.step_time_ratio()
    if cfg.pure_bf16:
        measured_pure = dev.cpu_adamw_pure if cfg.state_precision == "bf16" else None
        return measured_pure or dev.cpu_adamw * _PURE_CPU_RATE[cfg.state_precision]
    measured = {"fp32": dev.cpu_adamw, "bf16": dev.cpu_adamw_bf16, "int8": dev.cpu_adamw_int8}[cfg.state_precision]
    return measured or dev.cpu_adamw * _CPU_RATE[cfg.state_precision]


def _optimizer_seconds(ctx: Problem, prof: Profiles, cfg: Configuration, backward_s: np.ndarray) -> np.ndarray:
    """The step after the last backward: the device's part (memory-bound) and the host's (the offloaded share),
    which run side by side."""
    dev = ctx.device_profile
    numel = float(prof.trainable_numel)
    if cfg.distribution == "fsdp2":
        numel /= ctx.world
    on_host = numel * cfg.host_fraction
    on_device = numel - on_host
    if ctx.device == "cuda":
        tensors = len(prof.trainable_params) * (1 - cfg.host_fraction)
        step_bytes = (_PURE_STEP_BYTES if cfg.pure_bf16 else _STEP_BYTES)[cfg.state_precision]
        ops = _STEP_OPS["bf16" if cfg.pure_bf16 else cfg.state_precision]
        if not cfg.optimizer_class.is_adamw:
            step_bytes, ops = _named_step_bytes(prof, cfg.optimizer_class), _NAMED_STEP_OPS
        device_part = max(step_bytes * on_device / dev.memory_bandwidth, ops * tensors * dev.op_overhead_s)
    else:  # the "device" is the host: its own AdamW rate
        device_part = on_device / host_step_rate(dev, cfg)
    device_part = device_part + 0 * backward_s
    if on_host == 0:
        return device_part
    grad_bytes, _ = _optimizer_link(ctx, prof, cfg)
    # Gradients stream to the host during each micro-batch's backward, the host adds later micro-batches in;
    # after the last backward: the norms (clipping), the CPU step, then the last bucket's weights cross back.
    d2h = np.maximum(0.0, grad_bytes / dev.device_to_host - backward_s) * cfg.accumulation
    host_adds = (cfg.accumulation - 1) * 12 * on_host / dev.host_bandwidth
    norms = 4 * on_host / dev.host_bandwidth if ctx.grad_clip else 0.0
    last_bucket = min(grad_bytes, _BUCKET_BYTES * grad_bytes / (4 * on_host))
    host_part = d2h + host_adds + norms + on_host / host_step_rate(dev, cfg) + last_bucket / dev.host_to_device
    return np.maximum(device_part, host_part)


def _optimizer_link(ctx: Problem, prof: Profiles, cfg: Configuration) -> tuple[float, float]:
    """(bytes of gradients to the host per micro-batch, bytes of weights back per step) of the parameters whose
    step runs on the host (``memtrain.optim.offloaded_mask``, whole tensors): both in the device weights' dtype."""
    if cfg.host_fraction == 0:
        return 0.0, 0.0
    key = ("offloaded parameter bytes", cfg.host_fraction)
    if key not in prof.memo:
        mask = offloaded_mask([n for n, _ in prof.trainable_params], cfg.host_fraction)
        prof.memo[key] = float(sum(n * d.itemsize for (n, d), m in zip(prof.trainable_params, mask, strict=True) if m))
    device_bytes = prof.memo[key]
    if cfg.distribution == "fsdp2":
        device_bytes /= ctx.world  # each rank's shard
    return device_bytes, device_bytes


def _communication_seconds(ctx: Problem, prof: Profiles, cfg: Configuration, compute_s: np.ndarray) -> np.ndarray:
    n, dev = ctx.world, ctx.device_profile
    if cfg.distribution == "none" or n == 1:
        return 0.0 * compute_s
    share = (n - 1) / n
    grads = prof.trainable_bytes * share
    if cfg.distribution == "ddp":
        # One all-reduce per step, bucket by bucket during the last micro-batch's backward (2/3 of its compute).
        return np.maximum(0.0, 2 * grads / dev.interconnect - compute_s * 2 / 3)
    # All-gathers in forward and in backward (in bf16 under bf16-mixed), prefetched under compute; one fp32
    # reduce-scatter of the gradients.
    params = prof.parameter_bytes * _gathered_ratio(ctx, prof) * share
    gathers = 2 * params / dev.interconnect
    return np.maximum(0.0, gathers - 0.9 * compute_s) * cfg.accumulation + grads / dev.interconnect


def fsdp2_param_dtype(precision: str) -> torch.dtype | None:
    """The dtype FSDP2 gathers and computes a block's parameters in under ``precision`` (its
    ``MixedPrecisionPolicy.param_dtype``): bf16 under bf16-mixed, as torchtitan does, which halves the all-gather
    traffic and the gathered blocks' bytes; the gradients are reduce-scattered in fp32 into the fp32 shards the
    optimizer steps. None (the parameters' own dtype) under fp32 and fp16-mixed.

    NOTE: fp16-mixed keeps fp32 gathers. With fp16 parameters the whole residual stream would be fp16 (FSDP2 casts
    each block's inputs; the embeddings would return fp16), where autocast keeps it fp32: an activation beyond
    fp16's 65504 would be inf in forward, which the GradScaler (it scales the loss's gradient) cannot prevent, so
    every step would be skipped.
    """
    return torch.bfloat16 if precision == "bf16-mixed" else None


def _gathered_ratio(ctx: Problem, prof: Profiles) -> float:
    """Bytes of a parameter as FSDP2 gathers it over its bytes as traced (1, or 0.5 for fp32 weights gathered in
    bf16)."""
    dtype = fsdp2_param_dtype(ctx.precision)
    if dtype is None or not prof.trainable_params:
        return 1.0
    traced = sum(n * d.itemsize for n, d in prof.trainable_params)
    gathered = sum(n * (dtype if d.is_floating_point else d).itemsize for n, d in prof.trainable_params)
    return gathered / traced


def gathered_block_bytes(ctx: Problem, prof: Profiles) -> float:
    """The largest block's parameters as FSDP2 gathers them (``fsdp2_param_dtype``)."""
    return float(prof.block_parameter_bytes.max()) * _gathered_ratio(ctx, prof)


def _distributed_shift(ctx: Problem, prof: Profiles, cfg: Configuration | PlanSettings) -> float:
    """What DDP or FSDP2 changes at every moment of a one-process step of the same set-up, per rank (bytes); the
    gradients FSDP2 shards exist only from their backward on (``gradient_shard``)."""
    n = ctx.world
    if cfg.distribution == "none" or n == 1:
        return 0.0
    grads = float(prof.trainable_bytes)
    if cfg.distribution == "ddp":
        # DDP's flat all-reduce buckets exist from its construction on, and each gradient becomes a view into its
        # bucket (gradient_as_bucket_view=True) when the reducer copies it in, in the backward that syncs: the
        # gradients landing there are no extra bytes (gradient_shard). zero_grad(set_to_none=True) drops the
        # views each step, so a window's earlier micro-batches (no sync) accumulate into tensors of their own:
        # a device optimizer's trace counts those already; an offloaded one's streams them, but not under DDP.
        return grads * (2 if cfg.optimizer != "device" and cfg.accumulation > 1 else 1)
    # FSDP2: parameters and state sharded, the block computed and the next one (prefetched) gathered whole.
    state = prof.adamw_state_bytes if cfg.optimizer_class.is_adamw else named_state_bytes(
        prof, cfg.optimizer_class, 512 if ctx.device == "cuda" else 1)
    shift = -(prof.parameter_bytes + state) * (1 - 1 / n)
    return shift + 2 * gathered_block_bytes(ctx, prof)


def gradient_shard(ctx: Problem, cfg: Configuration | PlanSettings) -> float:
    """The share of the gradients a one-process step holds as they land that a rank does not hold beside what
    ``_distributed_shift`` adds: FSDP2 reduce-scatters each block's as it lands, unless accumulation keeps them
    unsharded between micro-batches; under DDP, in the backward that syncs, each one becomes a view into the
    buckets the shift counts (an offloaded optimizer's trace never holds them)."""
    if ctx.world == 1 or cfg.accumulation > 1:
        return 0.0
    if cfg.distribution == "ddp":
        return 1.0 if cfg.optimizer == "device" else 0.0
    return 1 - 1 / ctx.world if cfg.distribution == "fsdp2" else 0.0


def rank_peak(ctx: Problem, prof: Profiles, s: PlanSettings, t: Trace) -> float:
    """A rank's peak from a one-process trace: each run's peak less the sharded share of the gradients that had
    landed before it, the step's after all of them; then the shift every moment has."""
    sharded = gradient_shard(ctx, s)
    if not sharded or not t.runs:
        return t.report.peak_bytes + _distributed_shift(ctx, prof, s) + weights_shift(prof, s)
    landed, peak = 0, 0.0
    for run in t.runs:
        peak = max(peak, run.peak_bytes - sharded * landed)
        landed += run.gradient_bytes
    step = t.runs[-1].end_bytes + (0 if s.step_in_backward else t.step_temp_bytes)
    peak = max(peak, step - sharded * landed)
    if t.report.peak_bytes > max(max(r.peak_bytes for r in t.runs), step):  # a moment outside the runs: as is
        peak = max(peak, t.report.peak_bytes)
    return peak + _distributed_shift(ctx, prof, s) + weights_shift(prof, s)


class CandidateTable:
    """Every composed candidate as columns, ranked fastest first (then the smaller peak)."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.configs: list[Configuration] = []
        self._parts: list[tuple[np.ndarray, ...]] = []
        self.explicit: dict[int, PlanSettings] = {}  # rows with their own block layout
        self.searched = False  # some rows came from a search (around a fixed layout), not one given set-up

    def add(self, cfg: Configuration, offload: int | np.ndarray, recompute: np.ndarray, peak: np.ndarray,
            host: np.ndarray, seconds: np.ndarray) -> None:
        """Rows of ``cfg``, row k offloading ``offload`` (or ``offload[k]``) blocks and recomputing ``recompute[k]``."""
        if not self.configs or self.configs[-1] is not cfg:
            self.configs.append(cfg)
        index = len(self.configs) - 1
        offload = np.broadcast_to(np.asarray(offload, dtype=np.int64), recompute.shape)
        self._parts.append((np.full(len(recompute), index), offload, recompute, peak, host, seconds))

    def add_settings(self, cfg: Configuration, settings: PlanSettings, peak: np.ndarray, host: np.ndarray,
                     seconds: np.ndarray) -> None:
        """One candidate with any per-block assignment (not only offloaded, then recomputed, then kept)."""
        self.explicit[sum(len(part[0]) for part in self._parts)] = settings
        self.add(cfg, settings.blocks.count("offload"), np.array([settings.blocks.count("recompute")]), peak, host,
                 seconds)

    @property
    def empty(self) -> bool:
        """No candidate was added (the fixed choices rule out every set-up)."""
        return not self._parts

    def finish(self) -> None:
        cols = [np.concatenate(c) for c in zip(*self._parts, strict=True)]
        self.config, self.offload, self.recompute, self.peak, self.host, self.seconds = cols
        # Lean moments change the numerics (moments rounded or quantised): on speed alone they must beat fp32
        # moments by LEAN_MARGIN, more than a probe's noise, or plans would flip between runs on one machine (the
        # fused host kernels step bf16 moments about as fast as fp32 ones).
        lean = self.column("state_precision") != "fp32"
        self.order = np.lexsort((self.peak, np.where(lean, self.seconds * (1 + LEAN_MARGIN), self.seconds)))

    def settings(self, k: int) -> PlanSettings:
        if k in self.explicit:
            return self.explicit[k]
        return self.configs[int(self.config[k])].settings(self.n_blocks, int(self.offload[k]), int(self.recompute[k]))

    def column(self, name: str) -> np.ndarray:
        """A field of each row's configuration, e.g. "optimizer"."""
        values = np.array([getattr(c, name) for c in self.configs])  # typed (str, bool, ...): fast comparisons
        return values[self.config]

    def first(self, mask: np.ndarray) -> int | None:
        """The fastest row where ``mask`` holds."""
        hits = np.flatnonzero(mask[self.order])
        return int(self.order[hits[0]]) if len(hits) else None
