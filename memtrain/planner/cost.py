"""The cost model: a candidate's peak, host bytes and step time composed from the block profiles (``Composer``),
the host link and its stall, DDP/FSDP2 communication and memory, and each technique's own share (the optimizer's,
``memtrain.techniques.optimizer.cost``; parameter offload's, ``memtrain.techniques.weight_offload``);
``CandidateTable`` holds every composed candidate as columns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memtrain.estimate import Trace
from memtrain.offload import SLAB_BYTES_DEFAULT
from memtrain.planner.devices import DeviceProfile
from memtrain.planner.profiles import Profiles, affine_at, offloader_bytes
from memtrain.planner.settings import Configuration, HostLink, PlanSettings, Problem, configuration_of
from memtrain.techniques.chunked_loss import loss_tail, timed_share
from memtrain.techniques.distribution import (
    root_trainable_bytes,
    sharded_host_bytes,
    sharded_host_copies,
    sharded_host_micro_seconds,
    shards_on_host,
)
from memtrain.techniques.optimizer.cost import (
    OptimizerShare,
    full_state_bytes,
    profile_key,
    ranked_seconds,
    step_temp_after_backward,
    weights_profile,
)
from memtrain.techniques.tiled_mlp import profile_kind
from memtrain.techniques.weight_offload import (
    streamed_weight_bytes,
    weights_host_bytes,
    weights_micro_seconds,
    weights_shift,
)

# The data loader's share of host RAM, an allowance: the batch being copied to the device and the next one
# (DevicePrefetcher), each of int64 token rows (inputs and labels; position ids too when packed) pinned in torch's
# host cache, which rounds every block up to a power of two. The dataset's own pages (memory-mapped) are the OS's.
LOADER_BATCHES = 2


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
        self._shares: dict[tuple[Any, ...], OptimizerShare] = {}

    def share(self, prof: Profiles, cfg: Configuration) -> OptimizerShare:
        """The optimizer's share of ``cfg``'s figures over ``prof``: one per profiles and ``OptimizerShare.key``."""
        key = (id(prof), *OptimizerShare.key(cfg))
        if key not in self._shares:
            self._shares[key] = OptimizerShare(self.ctx, prof, cfg)
        return self._shares[key]

    def profile(self, optimizer: str, pure_bf16: bool = False) -> Profiles:
        """The profiles of the device weights' dtype: bf16 with an offloaded fp32 master, or pure bf16."""
        return self.profiles[weights_profile(optimizer, pure_bf16)]

    def profile_of(self, cfg: Configuration | PlanSettings) -> Profiles:
        """The profiles ``cfg`` reads (``profile``)."""
        return self.profiles[profile_key(cfg)]

    def _shards(self, cfg: Configuration) -> int:
        """The ranks the optimizer's parameters are sharded over: FSDP2's, else 1."""
        return self.ctx.world if cfg.distribution == "fsdp2" else 1

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
        b, prof = cfg.micro_batch_size, self.profile_of(cfg)
        # Blocks compiled one by one run their own code compiled whatever the set-up (see compile_model).
        keep = self.arrays(prof, profile_kind("keep", cfg), b, cfg.compile)
        rec = self.arrays(prof, profile_kind(cfg.flavor, cfg), b, cfg.compile) if is_rec.any() else keep
        off = self.arrays(prof, profile_kind("offload", cfg), b, cfg.compile) if is_off.any() else keep

        def pick(name: str) -> np.ndarray:
            return np.where(is_off, getattr(off, name), np.where(is_rec, getattr(rec, name), getattr(keep, name)))

        return pick

    def offloaded(self, cfg: Configuration, pick: Callable[[str], np.ndarray]) -> np.ndarray:
        """Bytes each block moves to the host (and back) in one micro-batch, (rows, blocks): none on a CPU."""
        offloaded = pick("offloaded")
        return offloaded if self.ctx.device == "cuda" else np.zeros_like(offloaded)

    def host_link(self, s: PlanSettings) -> HostLink:
        """Bytes over the host link in one optimizer step of ``s`` (per rank): the figures the time model's
        ``_offload_stall`` and ``OptimizerShare.step_seconds`` take."""
        cfg = configuration_of(s)
        kinds = np.array(s.blocks)[None, :]
        activations = float(self.offloaded(cfg, self.picker(cfg, kinds == "offload", kinds == "recompute")).sum())
        prof = self.profile_of(cfg)
        gradients, weights = self.share(prof, cfg).link(self._shards(cfg))
        if shards_on_host(cfg):  # the gradients' shards once a window; the weights' in each micro-batch
            copies, _ = sharded_host_copies(prof, self.ctx.world)
            return HostLink(round(activations * cfg.accumulation), round(activations * cfg.accumulation),
                            round(gradients), 0, round(copies * cfg.accumulation))
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
            key = (id(self.profile_of(cfg)), cfg.micro_batch_size, cfg.compile, profile_kind(cfg.flavor, cfg),
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
        prof = self.profile_of(cfg)
        layout = layout if layout is not None else Layout(self.picker(cfg, is_off, is_rec), is_off, is_rec)
        peak = self._peak(cfg, prof, layout)
        # -- host bytes (one node: every rank's share)
        offloaded = layout.memo("offloaded over the link", lambda: self.offloaded(cfg, layout))
        moved = layout.memo(("total", "offloaded over the link"), lambda: offloaded.sum(axis=1))
        host = (host_pool_bytes(moved) + self._optimizer_host_bytes(prof, cfg) + loader_host_bytes(ctx, b)
                + weights_host_bytes(prof, cfg)) * ranks_per_node(ctx.world)
        return peak, host, self._seconds(cfg, prof, layout, offloaded, moved)

    def _optimizer_host_bytes(self, prof: Profiles, cfg: Configuration) -> float:
        """One rank's host RAM for the optimizer: the offloaded optimizer's, or under FSDP2's host offload its
        shards of the weights, gradients and state."""
        if shards_on_host(cfg):
            state = full_state_bytes(prof, cfg.optimizer_class, "cpu")
            return sharded_host_bytes(prof, state, self.ctx.world, pinned=self.ctx.device == "cuda")
        return self.share(prof, cfg).host_bytes

    def _peak(self, cfg: Configuration, prof: Profiles, layout: Layout) -> np.ndarray:
        """The device's peak per row: forward block by block, the head and loss, backward from the last block to
        the first, then the step; one process (distributed ranks differ by ``_distributed_shift``)."""
        ctx, b = self.ctx, cfg.micro_batch_size
        tail = loss_tail(prof.tails, cfg)
        optimizer = self.share(prof, cfg)
        # A gradient that leaves the device as it lands (to the host, or stepped in backward), or is added into an
        # earlier micro-batch's and freed, does not stay: the "_streamed" figures.
        transient = optimizer.block_leaves | (cfg.accumulation > 1)
        suffix = "_streamed" if (optimizer.other_leaves or cfg.accumulation > 1) else ""
        saved, fexcess = layout("saved"), layout("forward_excess")
        bexcess, bnet, later = layout.backward(transient)
        fixed = (float(prof.fixed_bytes) + affine_at(prof.input_bytes, b) - prof.input_bytes[0] - prof.adamw_state_bytes
                 + optimizer.device_state_bytes)
        if cfg.accumulation > 1:
            fixed += optimizer.device_gradient_bytes  # the earlier micro-batches' gradients, alive from the start

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
        # FSDP2 frees the share of each block's gradient that other ranks own as it lands: at block i's backward the
        # gradients of the blocks after it. The root's (the head's) stay whole to the end of backward (``rank_peak``).
        sharded = gradient_shard(ctx, cfg)
        grads = np.asarray(prof.block_parameter_bytes, dtype=float)
        landed = sharded * (np.cumsum(grads[::-1])[::-1] - grads)
        blocks_peak = layout.memo(("backward peak", transient.tobytes(), first_block.tobytes(), landed.tobytes()),
                                  lambda: np.max(first_block[:, None] + later + bexcess - landed[None, :], axis=1))
        peak = np.maximum(peak, blocks_peak + optimizer.step_temp_in_backward)
        end_blocks = first_block + layout.memo(("total", "backward net", transient.tobytes()),
                                               lambda: bnet.sum(axis=1))
        peak = np.maximum(peak, end_blocks + getattr(tail, "post_excess" + suffix).at(b) - sharded * grads.sum())
        after = end_blocks + affine_at(getattr(tail, "post_net" + suffix), b)
        peak = np.maximum(peak, after + optimizer.step_temp_after_backward - sharded * float(prof.trainable_bytes))
        return peak + _distributed_shift(ctx, prof, cfg) + weights_shift(prof, cfg)

    def _seconds(self, cfg: Configuration, prof: Profiles, layout: Layout, offloaded: np.ndarray,
                 moved: np.ndarray) -> np.ndarray:
        """A step's seconds per row: the micro-batches (the blocks, the head, the waits for the host link), the
        optimizer step and the communication."""
        ctx, b = self.ctx, cfg.micro_batch_size
        tail = loss_tail(prof.tails, cfg)
        fwd, bwd = layout("forward_s"), layout("backward_s")
        dev = ctx.device_profile.for_precision(ctx.precision)  # a CPU's matmuls at its 16-bit rate under autocast
        tokens = b * ctx.seq_len
        # compile_model compiles block by block where an offloader's hooks must stay outside the compiled regions:
        # the embeddings, the last norm, the head and the loss then run eagerly.
        # The head and its logits on the counted labels alone, where the loss skips the rest (the traces count every
        # one); the last norm before them on every position.
        share = timed_share(cfg, ctx.kept_share)
        works = (tail.pre_work, tail.tail_fwd_work.on_share(share, tail.tail_fwd_every),
                 tail.tail_bwd_work.on_share(share, tail.tail_bwd_every), tail.post_work)

        def rest(compiled: bool) -> float:
            return sum(w.seconds(b, tokens, dev, compiled) for w in works)

        per_block = layout.memo("compiled per block", lambda: _compiled_per_block(cfg, layout.is_off, layout.is_rec))
        head = np.where(per_block, rest(False), rest(cfg.compile))
        micro = layout.total("forward_s") + layout.total("backward_s") + head
        if ctx.device == "cuda" and layout.memo("moves", lambda: bool(offloaded.any())):
            micro = micro + layout.memo("offload stall", lambda: _offload_stall(fwd, bwd, offloaded, dev))
        optimizer, shards = self.share(prof, cfg), self._shards(cfg)
        micro = weights_micro_seconds(ctx, prof, cfg, micro, fwd, bwd, layout.memo, dev, moved,
                                      optimizer.link(shards)[0])
        if shards_on_host(cfg) and ctx.device == "cuda":
            micro = sharded_host_micro_seconds(prof, ctx.world, micro, moved, dev.host_to_device)
        backward = layout.total("backward_s")
        seconds = (micro * cfg.accumulation + optimizer.step_seconds(backward, shards)
                   + _communication_seconds(ctx, prof, cfg, backward + layout.total("forward_s")))
        return seconds + optimizer.in_backward_seconds(dev)


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


def _compiled_per_block(cfg: Configuration, is_off: np.ndarray, is_rec: np.ndarray) -> np.ndarray:
    """Per row: whether ``compile_model`` compiles this set-up block by block (compiled, with a block that
    offloads its activations or its saved input), leaving the code between the blocks eager."""
    offloads = is_off.any(axis=1) | (is_rec.any(axis=1) & (cfg.flavor == "offload-inputs"))
    return offloads & cfg.compile


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
    params = float(np.sum(_gathered(ctx, prof))) * share
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


def _gathered(ctx: Problem, prof: Profiles) -> np.ndarray:
    """Each block's parameters (frozen ones too), then the root's, as FSDP2 gathers them (``fsdp2_param_dtype``)."""
    return prof.gathered_bytes[:, 0 if fsdp2_param_dtype(ctx.precision) is None else 1]


def gathered_block_bytes(ctx: Problem, prof: Profiles) -> float:
    """The largest block's parameters as FSDP2 gathers them."""
    return float(_gathered(ctx, prof)[:-1].max())


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
    # FSDP2: the block computed and the next one (prefetched) gathered whole, and the root's parameters (the
    # embeddings, the head) gathered from its forward to the end of backward (the root does not reshard).
    gathered = 2 * gathered_block_bytes(ctx, prof) + float(_gathered(ctx, prof)[-1])
    # A 4-bit layer's quantisation state (bitsandbytes' absmax, no parameter of its) stays whole on every rank.
    sharded = prof.parameter_bytes - prof.replicated_bytes
    if shards_on_host(cfg):
        # Every shard in host RAM (the offloaded optimizer's trace keeps no state on the device, and streams every
        # gradient away as it lands); between the micro-batches of a window the unsharded gradients stay on the
        # device (reduce-scattered at its end). The root's are reduce-scattered only at the end of backward: held
        # from the head's backward on in the gathered dtype, then cast into an fp32 reduce-scatter input beside them.
        root_gradients = root_trainable_bytes(prof) * (_gathered_ratio(ctx, prof) + 1)
        return (-sharded + gathered + root_gradients
                + (prof.trainable_bytes if cfg.accumulation > 1 else 0))
    # Parameters and state sharded.
    state = full_state_bytes(prof, cfg.optimizer_class, ctx.device)
    return -(sharded + state) * (1 - 1 / n) + gathered


def gradient_shard(ctx: Problem, cfg: Configuration | PlanSettings) -> float:
    """The share of the gradients a one-process step holds as they land that a rank does not hold beside what
    ``_distributed_shift`` adds: FSDP2 reduce-scatters each block's as it lands, unless accumulation keeps them
    unsharded between micro-batches; under DDP, in the backward that syncs, each one becomes a view into the
    buckets the shift counts (an offloaded optimizer's trace never holds them)."""
    if ctx.world == 1 or cfg.accumulation > 1 or shards_on_host(cfg):  # the last: they leave as they land
        return 0.0
    if cfg.distribution == "ddp":
        return 1.0 if cfg.optimizer == "device" else 0.0
    return 1 - 1 / ctx.world if cfg.distribution == "fsdp2" else 0.0


def fitting_peak(peak: float, t: Trace, margin: float | None) -> float:
    """A fully estimated ``peak`` as the budget less its ``margin`` sees it: the peak, or where the caching
    allocator's segments need more of the whole budget (``MemoryReport.needed_bytes``, shifted as ``peak`` is from
    the traced step: the ranks' shards, the streamed weights), that need less the margin. So a set-up fits when its
    peak fits the budget less the margin and the allocator's least memory fits the budget, and ``fitting_peak / (1 -
    margin)`` is the least budget that holds it. ``margin`` None: no budget."""
    if margin is None:
        return peak
    # Rounded down as the usable bytes are (``int(budget * (1 - margin))``): a need of the whole budget fits.
    return max(peak, math.floor((peak + segments_beyond(t)) * (1 - margin)))


def composed_fitting(peak: Any, segments: float, margin: float | None) -> Any:
    """``fitting_peak`` of composed peaks (a float or an array), with ``segments`` for what the allocator's segments
    need beyond them: the most a full estimate showed (``FullEstimates``), which composition cannot."""
    if margin is None:
        return peak
    return np.maximum(peak, np.floor((np.asarray(peak) + segments) * (1 - margin)))


def segments_beyond(t: Trace) -> float:
    """What the caching allocator's segments need beyond the traced step's peak (``MemoryReport.needed_bytes``:
    pages rounded up, holes; 0 where the estimate has none)."""
    needed = t.report.needed_bytes
    return 0.0 if needed is None else max(0.0, needed - (t.report.peak_bytes or 0))


def rank_peak(ctx: Problem, prof: Profiles, s: PlanSettings, t: Trace) -> float:
    """A rank's peak from a one-process trace: each run's peak less the sharded share of the gradients that had
    landed before it (under FSDP2, the blocks'), the step's after all of them; then the shift every moment has."""
    sharded = gradient_shard(ctx, s)
    if not sharded or not t.runs:
        return t.report.peak_bytes + _distributed_shift(ctx, prof, s) + weights_shift(prof, s)
    # FSDP2 reduce-scatters the root's gradients (the head's, the embeddings') only at the end of backward: its
    # post-backward waits for the whole model's backward. DDP copies every gradient into its bucket as it lands.
    blocks = frozenset(ctx.block_names) if s.distribution == "fsdp2" else None
    landed, root, peak = 0, 0, 0.0
    for run in t.runs:
        peak = max(peak, run.peak_bytes - sharded * landed)
        if blocks is None or run.label in blocks:
            landed += run.gradient_bytes
        else:
            root += run.gradient_bytes
    step = t.runs[-1].end_bytes + step_temp_after_backward(s, t.step_temp_bytes)
    peak = max(peak, step - sharded * (landed + root))
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
        # Lean moments must beat fp32 ones by a margin on speed alone (the optimizer's ``ranked_seconds``).
        self.order = np.lexsort((self.peak, ranked_seconds(self.seconds, self.column)))

    def settings(self, k: int) -> PlanSettings:
        if k in self.explicit:
            return self.explicit[k]
        return self.configs[int(self.config[k])].assigned(self.n_blocks, int(self.offload[k]), int(self.recompute[k]))

    def column(self, name: str) -> np.ndarray:
        """A field of each row's configuration, e.g. "optimizer"."""
        values = np.array([getattr(c, name) for c in self.configs])  # typed (str, bool, ...): fast comparisons
        return values[self.config]

    def first(self, mask: np.ndarray) -> int | None:
        """The fastest row where ``mask`` holds."""
        hits = np.flatnonzero(mask[self.order])
        return int(self.order[hits[0]]) if len(hits) else None


class FullEstimates:
    """The rows of a ``CandidateTable`` estimated in full (each: its peak, with any correction, and its trace), and
    what they showed about the composed peaks of the others, which every judgement of a row shares (the search, the
    runners-up, the refusal):
    - a full estimate above its composed peak says what composition missed for that shape of candidate (the same
      configuration, with or without offloaded blocks): every composed row of that shape carries the most missed;
    - what the allocator's segments need beyond a full estimate's peak (its pages' rounding and holes): every
      composed row carries the most seen, as its full estimate would (``composed_fitting``).
    ``margin``: the budget's safety margin, None where there is no budget."""

    def __init__(self, results: CandidateTable, margin: float | None):
        self.results, self.margin = results, margin
        self._rows: dict[int, tuple[float, Trace]] = {}
        self._missed: dict[tuple[int, bool], float] = {}  # shape: the most composition missed
        self._segments = 0.0

    def __contains__(self, k: int) -> bool:
        return k in self._rows

    def __getitem__(self, k: int) -> tuple[float, Trace]:
        return self._rows[k]

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, k: int, peak: float, t: Trace) -> float:
        """Row ``k``'s full estimate (``peak`` with any correction, and its trace), and what it shows of the composed
        rows; returns its ``fitting_peak``."""
        self._rows[k] = peak, t
        shape = self._shape(k)
        self._missed[shape] = max(self._missed.get(shape, 0.0), peak - float(self.results.peak[k]))
        self._segments = max(self._segments, segments_beyond(t))
        return fitting_peak(peak, t, self.margin)

    def overshoot(self, correction: float = 0.0) -> float:
        """The most a row's composed peak was above its full estimate (less the plan's ``correction``), 0 where none
        was: how high composition was seen to err (memtrain's own chunked loss composes high)."""
        return max([0.0] + [float(self.results.peak[k]) - (peak - correction) for k, (peak, _) in self._rows.items()])

    def _shape(self, k: int) -> tuple[int, bool]:
        return int(self.results.config[k]), bool(self.results.offload[k])

    def peak(self, k: int) -> float:
        """Row ``k``'s peak: its full estimate's, else its composed one with what composition missed for its shape."""
        if k in self._rows:
            return self._rows[k][0]
        return float(self.results.peak[k]) + self._missed.get(self._shape(k), 0.0)

    def fitting(self, k: int) -> float:
        """Row ``k``'s peak as the budget less the margin sees it (``fitting_peak``, ``composed_fitting``)."""
        if k in self._rows:
            return fitting_peak(*self._rows[k], self.margin)
        return float(composed_fitting(self.peak(k), self._segments, self.margin))

    def fitting_all(self) -> np.ndarray:
        """``fitting`` of every row."""
        r = self.results
        peaks = r.peak.astype(np.float64)  # a copy
        for (config, offloaded), missed in self._missed.items():
            peaks[(r.config == config) & ((r.offload > 0) == offloaded)] += missed
        out = np.asarray(composed_fitting(peaks, self._segments, self.margin), dtype=np.float64)
        for k in self._rows:
            out[k] = self.fitting(k)
        return out
