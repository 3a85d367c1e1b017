"""The traced step prepared: the model (a meta copy with the checkpointing and the loss asked for), its inputs as
fake tensors, and what watches the step (the live tracker, gradient hooks, CUDA's rules, the meter, the simulated
offload), set up in the order the estimate was calibrated with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrain.checkpointing import (
    CheckpointedForward,
    Checkpointing,
    apply_checkpointing,
    remove_checkpointing,
)
from memtrain.estimate.arguments import WEIGHT_DTYPES, check_against_model
from memtrain.estimate.attribution import BlockMeter, Where
from memtrain.estimate.cuda import CUDA_WORKSPACE_BYTES, CudaRules
from memtrain.estimate.fake import convert_weights, meta_model, to_fake
from memtrain.estimate.optimizer_state import OptimizerFigures
from memtrain.estimate.simulated_offload import SimulatedOffload, simulate_offload
from memtrain.estimate.tracker import LiveTracker
from memtrain.loss import apply_chunked_loss, output_head, remove_chunked_loss
from memtrain.offload import ActivationOffloader, find_output_head
from memtrain.tiled_mlp import TiledForward, apply_tiled_mlp, remove_tiled_mlp, tiled_mlp_tokens


@dataclass
class Watch:
    """What watches the traced step: where it is, every storage alive, what is saved, CUDA's rules (None on the
    CPU), the simulated offload (None without), and the bytes alive after each phase."""

    where: Where
    tracker: LiveTracker
    meter: BlockMeter
    rules: CudaRules | None
    offload: SimulatedOffload | None
    cpu_autocast: Any  # the CPU's own autocast for a CPU target (CUDA's is emulated by the rules)
    whole_forward: Any  # the offload when it takes the whole forward (no checkpointing), else a null context
    hooks: list[Any]  # gradient hooks, removed when the step ends
    landed: dict[int, tuple[int, int, int]] | None  # gradient serial -> (bytes, run index, landing serial)
    fixed_bytes: int  # allocated before forward
    workspace: int  # the cuBLAS workspaces' bytes (CUDA)
    phase_bytes: list[tuple[str, int]] = field(default_factory=list)


class NullContext:
    """``contextlib.nullcontext``, but reusable inside one ``with`` statement list."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- the model and its inputs ---------------------------------------------------------------------------------
def prepare_model(model: Any, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                   ckpt: Checkpointing | dict[str, Any] | None, *, weights_dtype: str | None, chunked_loss: bool,
                   offload_activations: bool, tiled_mlp: bool = False
                   ) -> tuple[nn.Module, dict[str, Any] | None, bool, int]:
    """A meta copy of ``model`` in training mode, checked against the batch, with the checkpointing and the loss
    asked for applied. Returns (it, the ``apply_checkpointing`` arguments, whether anything offloads, the loss's
    chunk size)."""
    meta = meta_model(model)
    meta.train()
    if getattr(getattr(meta, "config", None), "use_cache", False):
        meta.config.use_cache = False  # as memtrain trains: a KV cache only holds memory in a training step
    if WEIGHT_DTYPES[weights_dtype] is not None:
        convert_weights(meta, WEIGHT_DTYPES[weights_dtype])
    chunk_tokens = check_against_model(meta, spec, chunked_loss, tiled_mlp=tiled_mlp)
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
    # As apply_plan's stage does: the model's own tiling undone, then applied where asked (at the model's own tile
    # size where it has one; check_against_model refused a model with no MLP to tile).
    own_tile = tiled_mlp_tokens(meta)
    remove_tiled_mlp(meta)
    if tiled_mlp:
        apply_tiled_mlp(meta, tile_tokens=own_tile or None)
    return meta, kwargs, offloads, chunk_tokens


def fake_inputs(meta: nn.Module, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 on_cuda: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """(the tensor mode the step runs in, the batch's inputs in it); the model's tensors moved into it."""
    # CUDA: meta tensors (fast: the CUDA rules above choose kernels and dtypes). CPU: fake CPU tensors, so that
    # the CPU's own kernel choices (attention) and autocast apply exactly as in a real CPU run.
    fake_mode: Any = NullContext()
    if not on_cuda:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # stray tensor attributes become fake
        to_fake(meta, fake_mode)
    with fake_mode:
        inputs = {key: torch.empty(shape, dtype=dtype, device="meta" if on_cuda else "cpu")
                  for key, (shape, dtype) in spec.items()}
    return fake_mode, inputs


# -- what watches the step ------------------------------------------------------------------------------------
def _start_tracker(meta: nn.Module, inputs: Mapping[str, torch.Tensor], where: Where, round_to: int,
                   state_bytes: int, *, record: bool, replay: bool, on_cuda: bool,
                   trainable: list[nn.Parameter] = ()) -> tuple[LiveTracker, int]:
    """A tracker holding what is alive before forward: parameters, buffers, inputs, the optimizer state and (CUDA)
    the cuBLAS workspaces. Returns it and the workspaces' bytes. The state is given blocks as AdamW allocates it
    (two moments per trainable parameter, its share of the bytes by its size), for the allocator's segments."""
    tracker = LiveTracker(round_to, where)
    tracker.cuda_workspaces = on_cuda  # CUDA's kernels' (an embedding backward's), not a simulated device's
    tracker.cpu_kernels = not on_cuda  # the CPU's (its flash attention's scratch)
    tracker.recording = record
    if replay:
        tracker.replay = {}
    for name, p in meta.named_parameters():
        tracker.add(p, ("state", name, "parameter", tuple(p.shape), p.dtype))
    for name, b in meta.named_buffers():
        tracker.add(b, ("state", name, "buffer", tuple(b.shape), b.dtype))
    for name, t in inputs.items():
        tracker.add(t, ("input", name, "input", tuple(t.shape), t.dtype))
    numels = [p.numel() for p in trainable]
    total = sum(numels)
    shares = [state_bytes * n // (2 * total) for n in numels for _ in range(2)] if total and state_bytes else []
    for nbytes in shares:
        tracker.add_block(nbytes)
    tracker.add_block(state_bytes - sum(shares))  # what the shares round away (none or a few bytes)
    workspace = CUDA_WORKSPACE_BYTES if on_cuda else 0
    tracker.add_block(workspace)
    return tracker, workspace


def _gradient_hooks(tracker: LiveTracker, fake_mode: Any, trainable: list[nn.Parameter],
                    leaving: list[nn.Parameter], accumulation: int, *,
                    note_landings: bool) -> tuple[list[Any], dict[int, tuple[int, int, int]] | None]:
    """Gradients as the loop holds them: those ``leaving`` dropped once accumulated, the earlier micro-batches' alive
    from the start (``accumulation > 1``). Returns the hooks and, with ``note_landings``, the landings they note
    (gradient serial -> (bytes, run index, landing serial))."""
    streamed = bool(leaving)
    landed = None
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
    if note_landings:
        # Which run each gradient came into being in, and whether before its peak: what a streaming optimizer (or
        # accumulation, which adds each new gradient into the old one and frees it) would not hold there.
        # Keyed by the gradient's allocation serial; the landing serial is when a streaming optimizer takes it
        # (the chunked loss allocates the head's gradient at its first chunk and fills it over the others).
        landed: dict[int, tuple[int, int, int]] = {}

        def note(p: torch.Tensor) -> None:
            entry = tracker.live.get(p.grad.untyped_storage()._cdata)
            if entry is not None and tracker.runs and entry[2] not in landed:
                landed[entry[2]] = (entry[0], len(tracker.runs) - 1, tracker.serial)

        hooks = [p.register_post_accumulate_grad_hook(note) for p in trainable]
    return hooks, landed


def _cuda_rules(meta: nn.Module, where: Where, tracker: LiveTracker, autocast_dtype: torch.dtype | None, *,
                on_cuda: bool, chunked_loss: bool) -> CudaRules | None:
    """CUDA's rules for the step (None on the CPU); every checkpointed block's recompute runs as its block and,
    on CUDA, under the same rules."""
    rules = CudaRules(autocast_dtype) if on_cuda else None
    for module in meta.modules():
        wrapped = module.__dict__.get("forward")
        if isinstance(wrapped, CheckpointedForward):
            wrapped.original = where.around(module, wrapped.original)
            if rules is not None:
                wrapped.original = rules.around_recompute(wrapped.original)
    if rules is not None:
        for module in meta.modules():  # each tile is recomputed in backward: under the same rules
            tiled = module.__dict__.get("forward")
            if isinstance(tiled, TiledForward):
                tiled.untiled = rules.around_recompute(tiled.untiled)
        rules.tracker = tracker
        if chunked_loss:  # each chunk's logits are recomputed in backward: under the same rules
            head = output_head(meta)
            head.forward = rules.around_recompute(head.forward)  # type: ignore[method-assign]
    return rules


def _offload(meta: nn.Module, meter: BlockMeter, params: list[nn.Parameter], *, offloads: bool,
             offload_activations: bool, offload_min_bytes: int) -> tuple[SimulatedOffload | None, Any]:
    """The simulated offload the wrapped blocks use (None without), and the context the whole forward runs in (it,
    when nothing is checkpointed but activations offload)."""
    offload = None
    whole_forward: Any = NullContext()
    if offloads:
        state_storages = {t.untyped_storage()._cdata for t in (*meta.parameters(), *meta.buffers())}
        offload = SimulatedOffload(meter, state_storages, min_bytes=offload_min_bytes, frozen_shapes=frozenset(
            tuple(p.shape) for p in params if not p.requires_grad))
        if not simulate_offload(meta, offload) and offload_activations:
            # No checkpointing: the whole forward is offloaded, but for what the head and the loss save.
            whole_forward = offload
            head = find_output_head(meta)
            if head is not None:
                head.register_forward_pre_hook(lambda module, args: setattr(offload, "in_tail", True))
    return offload, whole_forward


def watch_step(meta: nn.Module, inputs: Mapping[str, torch.Tensor], params: list[nn.Parameter],
               trainable: list[nn.Parameter], optim: OptimizerFigures, fake_mode: Any, *, round_to: int,
               record: bool, replay: bool, on_cuda: bool, autocast_dtype: torch.dtype | None, accumulation: int,
               chunked_loss: bool, offloads: bool, offload_activations: bool, offload_min_bytes: int) -> Watch:
    """What watches the step, set up in order: the tracker (with what is alive before forward), the gradient
    hooks, CUDA's rules, the CPU's autocast, the meter and the simulated offload."""
    streamed = bool(optim.leaving)
    where = Where(meta)
    tracker, workspace = _start_tracker(meta, inputs, where, round_to, optim.state_bytes, record=record,
                                        replay=replay, on_cuda=on_cuda, trainable=trainable)
    hooks, landed = _gradient_hooks(tracker, fake_mode, trainable, optim.leaving, accumulation,
                                    note_landings=record and not streamed and accumulation == 1)
    fixed_bytes = tracker.current
    rules = _cuda_rules(meta, where, tracker, autocast_dtype, on_cuda=on_cuda, chunked_loss=chunked_loss)
    cpu_autocast = (torch.autocast("cpu", dtype=autocast_dtype, cache_enabled=False) if (autocast_dtype and not on_cuda)
                    else NullContext())
    meter = BlockMeter(meta, where, tracker)
    offload, whole_forward = _offload(meta, meter, params, offloads=offloads,
                                      offload_activations=offload_activations,
                                      offload_min_bytes=offload_min_bytes)
    return Watch(where, tracker, meter, rules, offload, cpu_autocast, whole_forward, hooks, landed, fixed_bytes,
                 workspace)
