"""Profiling a model: the step traced on fake tensors with every block of one kind, at two micro-batches (a
copy truncated to six blocks where the blocks are identical), and the model state's bytes as a trace counts them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from memtrain.checkpointing import find_blocks
from memtrain.errors import MemtrainError
from memtrain.estimate import Trace, meta_model, optimizer_bytes, round_up, trace
from memtrain.planner.profiles import (
    KindProfile,
    PeakEnvelope,
    Profiles,
    TailProfile,
    kind_profile,
    tail_profile,
)
from memtrain.planner.settings import Problem
from memtrain.quantize import is_quant_state
from memtrain.techniques.tiled_mlp import kind_name

# -- the step traced with every block of one kind ----------------------------------------------------------
_KIND_CHECKPOINTING: dict[str, Any] = {
    "keep": "none",
    "full": {"every": 1},
    "selective": {"every": 1, "selective": ("matmul", "attention")},
    "offload-inputs": {"every": 1, "offload": True},
}


_LEAD = 5  # blocks kept in front by truncated_copy


def truncated_copy(model: nn.Module, blocks: Sequence[str]) -> tuple[nn.Module, list[int]] | None:
    """A copy of ``model`` keeping only its first ``_LEAD`` blocks and its last, and the block of that copy each
    block of the model is profiled by: when the blocks are the children of one ModuleList (or Sequential) and
    structurally identical (same class, parameter and buffer shapes), the interior blocks' profiles are the same,
    and tracing six costs what tracing eighty would. Several in front: in backward the offloader fetches two
    records ahead, and tensors every block shares (rotary tables) come first, so the first blocks differ; the
    last two in front must profile alike (``profiles_from_traces`` checks) for the last to stand for the interior.
    None where the model's blocks are not of that kind."""
    if len(blocks) <= _LEAD + 1:
        return None
    parents = {name.rpartition(".")[0] for name in blocks}
    modules = dict(model.named_modules())
    container = modules.get(parents.pop()) if len(parents) == 1 else None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) != len(blocks):
        return None

    def signature(m: nn.Module) -> tuple[Any, ...]:
        return (type(m), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()),
                tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))

    if len({signature(m) for m in container}) != 1:
        return None

    copy = meta_model(model, leave_out=list(container)[_LEAD:-1])  # the interior blocks: not copied, dropped
    parent_name = next(iter({name.rpartition(".")[0] for name in blocks}))
    holder_name, _, attr = parent_name.rpartition(".")
    holder = dict(copy.named_modules())[holder_name]
    kept = getattr(holder, attr)
    # NOTE: the config keeps its layer count: Hugging Face models loop over self.layers[:num_hidden_layers], and
    # every submodule shares the one config object (a copy would part them: e.g. use_cache off in one only).
    setattr(holder, attr, type(kept)([*list(kept)[:_LEAD], kept[len(kept) - 1]]))
    return copy, list(range(_LEAD - 1)) + [_LEAD - 1] * (len(blocks) - _LEAD) + [_LEAD]


def step_batch(ctx: Problem, micro_batch_size: int) -> Any:
    """The batch a trace of ``ctx`` passes at ``micro_batch_size``: token ids as a shape, or for packed rows
    (``ctx.packed``) of a model that reads ``position_ids`` the three tensors the loop passes (input_ids, labels,
    position_ids: a Hugging Face model then builds a block-diagonal attention mask, as in the real run)."""
    shape = (micro_batch_size, ctx.seq_len)
    if not ctx.packed or not _takes_position_ids(ctx.model):
        return shape
    return dict.fromkeys(("input_ids", "labels", "position_ids"), shape)


def _takes_position_ids(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``position_ids`` (by name, or through ``**kwargs``: PEFT's wrapper)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "position_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def state_bytes(model: nn.Module, blocks: Sequence[str], weights: str | None, cuda: bool,
                no_gradient: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The model's state as a trace counts it (parameters in the traced dtype, rounded as the allocator does, and
    AdamW's state), without tracing; the trainable parameters named in ``no_gradient`` (the step gives them no
    gradient: ``Trace.no_gradient``) have neither gradient nor state."""
    dtype = torch.bfloat16 if weights == "bf16" else None
    round_to = 512 if cuda else 1
    named = dict(model.named_parameters())
    params = list(named.values())
    as_traced = {id(p): (p.detach().to(dtype) if dtype is not None and p.is_floating_point() else p.detach())
                 for p in params}
    trainable = [as_traced[id(p)] for name, p in named.items() if p.requires_grad and name not in no_gradient]
    buffers = list(dict.fromkeys(model.buffers()))
    modules = dict(model.named_modules())
    block_of = {id(p): i for i, name in enumerate(blocks) for p in modules[name].parameters()}
    # FSDP2 gathers every parameter of a group, frozen ones too, each floating one in the mixed-precision dtype
    # where there is one; a 4-bit layer's quantisation state is no parameter of bitsandbytes' (every rank keeps it).
    replicated = {id(p) for m in modules.values() for n, p in m.named_parameters(recurse=False)
                  if is_quant_state(m, n)}
    gathered = np.zeros((len(blocks) + 1, 2))  # per block, then the root: bytes as traced, and in 2-byte floats
    for p in dict.fromkeys(params):
        if id(p) not in replicated:
            t = as_traced[id(p)]
            gathered[block_of.get(id(p), -1)] += (t.numel() * t.element_size(),
                                                  t.numel() * (2 if t.is_floating_point() else t.element_size()))
    return {
        "rounded": sum(round_up(t.numel() * t.element_size(), round_to) for t in (*as_traced.values(), *buffers)),
        "parameters": sum(t.numel() * t.element_size() for t in as_traced.values()),
        "trainable": sum(t.numel() * t.element_size() for t in trainable),
        "numel": sum(t.numel() for t in trainable),
        "state": optimizer_bytes(trainable, "adamw", round_to)[0],
        "blocks": np.array([sum(as_traced[id(p)].numel() * as_traced[id(p)].element_size()
                                for n, p in modules[name].named_parameters(prefix=name)
                                if p.requires_grad and n not in no_gradient) for name in blocks], dtype=np.float64),
        "gathered": gathered,
        "sharded": [(as_traced[id(p)].numel(), as_traced[id(p)].dtype, p.requires_grad and name not in no_gradient)
                    for name, p in named.items() if id(p) not in replicated],
        "replicated": sum(as_traced[i].numel() * as_traced[i].element_size() for i in replicated),
        "params": [(t.numel(), t.dtype) for t in trainable],
        "shapes": [tuple(t.shape) for t in trainable],
        "param_blocks": np.array([block_of.get(id(p), -1) for name, p in named.items()
                                  if p.requires_grad and name not in no_gradient], dtype=np.int64),
    }


def build_profiles(ctx: Problem, flavors: Sequence[str], offload: bool, weights: str | None,
                   tiled: bool = False) -> Profiles:
    """Traces the step with every block of one kind, at micro-batches 1 and 2, and cuts the traces into
    per-block profiles (two traces a kind; ``tiled``: each kind again with its MLP tiled, ``kind_name``).
    Identical blocks are traced three of them (see truncated_copy)."""
    truncated = truncated_copy(ctx.model, ctx.block_names)
    if truncated is not None:
        try:
            return profiles_from_traces(ctx, flavors, offload, weights, truncated, tiled)
        except MemtrainError:
            # A model whose forward needs every block (it indexes them by its config), or whose interior blocks
            # do not profile alike: trace it whole.
            pass
    return profiles_from_traces(ctx, flavors, offload, weights, None, tiled)


def profiles_from_traces(ctx: Problem, flavors: Sequence[str], offload: bool, weights: str | None,
                     truncated: tuple[nn.Module, list[int]] | None, tiled: bool = False) -> Profiles:
    traced_model, index = truncated if truncated is not None else (ctx.model, list(range(len(ctx.block_names))))

    traced_blocks = find_blocks(traced_model)
    kinds = {k: _KIND_CHECKPOINTING[k] for k in ("keep", *flavors)}
    if offload:
        kinds["offload"] = {"policies": dict.fromkeys(traced_blocks, "offload")}
    block_kinds = list(kinds)
    if ctx.chunkable and not flavors:
        kinds["keep-chunked"] = "none"  # no recomputed kind to carry the chunked loss: a trace of its own for it
    if tiled:  # the blocks' kinds again with the MLP tiled (the loss's figures are the untiled traces')
        kinds.update({kind_name(k, True): kinds[k] for k in block_kinds})
    traces: dict[str, tuple[Trace, Trace]] = {}
    for kind, checkpointing in kinds.items():
        # The kept and offloaded traces carry the whole loss, the others the chunked one (where the model has it):
        # the loss's own figures do not depend on the blocks' kind.
        chunked = ctx.chunkable and kind.removesuffix("+tiled") not in ("keep", "offload")
        first, second = (trace(traced_model, step_batch(ctx, b), device=ctx.device, precision=ctx.precision,
                               checkpointing=checkpointing, chunked_loss=chunked, optimizer="adamw",
                               weights_dtype=weights, runs=True, offload_min_bytes=0,
                               tiled_mlp=kind.endswith("+tiled")) for b in (1, 2))
        # offload_min_bytes=0: every storage the offloader could move is recorded with its size, and offloader_bytes keeps
        # those at least its threshold at the candidate's micro-batch.
        traces[kind] = (first, second)
    keep1, _ = traces["keep"]
    chunked_kept = next((k for k in kinds if k in ("full", "selective", "keep-chunked")), "")
    whole_shift = _input_shift(traces, "keep", "offload")
    chunked_shift = _input_shift(traces, chunked_kept, "offload-inputs")
    tails = {False: _tail_profiles(traces, "keep", "offload", whole_shift or chunked_shift)}
    if ctx.chunkable:
        tails[True] = _tail_profiles(traces, chunked_kept, "offload-inputs", chunked_shift or whole_shift)
    cuda = ctx.device == "cuda"
    no_gradient = frozenset(keep1.no_gradient)
    full = state_bytes(ctx.model, ctx.block_names, weights, cuda,
                       _in_model(no_gradient, traced_blocks, ctx.block_names, index))
    fixed = keep1.fixed_bytes
    if truncated is not None:  # the fixed bytes of the whole model: its parameters and state, not the copy's
        part = state_bytes(traced_model, traced_blocks, weights, cuda, no_gradient)
        fixed += (full["rounded"] + full["state"]) - (part["rounded"] + part["state"])
    batch = step_batch(ctx, 1)
    input_bytes = ctx.seq_len * 8 * (len(batch) if isinstance(batch, dict) else 1)  # int64 ids, one example
    kind_profiles = {k: kind_profile(*pair) for k, pair in traces.items()}
    if truncated is not None and not all(_alike(kp, _LEAD - 2, _LEAD - 1) for kp in kind_profiles.values()):
        raise _NotRepresentative  # the interior does not repeat: trace the whole model
    return Profiles(
        kinds={k: _expand(kp, index) for k, kp in kind_profiles.items()},
        tails=tails,
        fixed_bytes=fixed,
        input_bytes=(float(input_bytes), float(input_bytes)),
        parameter_bytes=full["parameters"],
        trainable_bytes=full["trainable"],
        trainable_numel=full["numel"],
        block_parameter_bytes=full["blocks"],
        gathered_bytes=full["gathered"],
        replicated_bytes=full["replicated"],
        sharded_params=full["sharded"],
        adamw_state_bytes=full["state"],
        traces=2 * len(kinds),
        trainable_params=full["params"],
        trainable_shapes=full["shapes"],
        trainable_blocks=full["param_blocks"],
    )


def _in_model(names: frozenset[str], traced_blocks: Sequence[str], blocks: Sequence[str],
              index: Sequence[int]) -> frozenset[str]:
    """Parameter names of the traced copy as the model's: a block's stand for every block it profiles (``index``:
    which traced block each of the model's is)."""
    out = set()
    for name in names:
        k = next((k for k, b in enumerate(traced_blocks) if name.startswith(b + ".")), None)
        rest = name[len(traced_blocks[k]):] if k is not None else ""
        out.update([name] if k is None else (blocks[j] + rest for j, i in enumerate(index) if i == k))
    return frozenset(out)


def _tail_profiles(traces: dict[str, tuple[Trace, Trace]], kept: str | None, offloaded: str | None,
                   shift: tuple[float, float] | None = None) -> TailProfile:
    """The loss's profile from a trace whose first block keeps its input (``kept``) and, for the head's forward,
    from one whose first block offloads it (``offloaded``). With only one of them, ``shift`` (how much less the
    other loss's forward end holds when the input is offloaded) stands in for the missing one."""
    kept = kept if kept in traces else None
    offloaded = offloaded if offloaded in traces else None
    base = tail_profile(*traces[kept or offloaded])  # type: ignore[index]
    if kept is not None and offloaded is not None:
        other = tail_profile(*traces[offloaded])
        base.tail_fwd_net_offloaded, base.tail_fwd_excess_offloaded = other.tail_fwd_net, other.tail_fwd_excess
        return base
    d1, slope = shift if shift is not None else (0.0, 0.0)
    if kept is None:  # traced with the input offloaded: the kept case holds it again
        d1, slope = -d1, -slope
        base.tail_fwd_net_offloaded, base.tail_fwd_excess_offloaded = base.tail_fwd_net, base.tail_fwd_excess
        base.tail_fwd_net = (base.tail_fwd_net[0] + d1, base.tail_fwd_net[1] + slope)
        base.tail_fwd_excess = PeakEnvelope(base.tail_fwd_excess.lines + np.array([d1, slope]))
        return base
    base.tail_fwd_net_offloaded = (base.tail_fwd_net[0] + d1, base.tail_fwd_net[1] + slope)
    base.tail_fwd_excess_offloaded = PeakEnvelope(base.tail_fwd_excess.lines + np.array([d1, slope]))
    return base


def _input_shift(traces: dict[str, tuple[Trace, Trace]], kept: str, offloaded: str) -> tuple[float, float] | None:
    """What offloading the first block's input changes in the forward end of one loss, when both were traced."""
    if kept not in traces or offloaded not in traces:
        return None
    a, b = tail_profile(*traces[kept]), tail_profile(*traces[offloaded])
    return b.tail_fwd_net[0] - a.tail_fwd_net[0], b.tail_fwd_net[1] - a.tail_fwd_net[1]


class _NotRepresentative(MemtrainError):
    """The truncated copy's leading blocks did not settle into the interior's profile."""


def _alike(kp: KindProfile, i: int, j: int) -> bool:
    """Blocks ``i`` and ``j`` have the same profile (bytes, peaks at micro-batches 1 and 2, work)."""
    for f in dataclasses.fields(kp):
        value = getattr(kp, f.name)
        if isinstance(value, np.ndarray):
            if not np.array_equal(value[i], value[j]):
                return False
        elif isinstance(value[i], PeakEnvelope):
            if any(value[i].at(b) != value[j].at(b) for b in (1, 2)):
                return False
        elif value[i] is None or isinstance(value[i], np.ndarray):  # offloaded_tensors
            if (value[i] is None) != (value[j] is None) or (value[i] is not None
                                                            and not np.array_equal(value[i], value[j])):
                return False
        elif value[i] != value[j]:
            return False
    return True


def _expand(kp: KindProfile, index: list[int]) -> KindProfile:
    """A profile of the traced blocks, for every block of the model (``index``: which traced block each is)."""
    if index == list(range(len(index))):
        return kp
    fields = {f.name: getattr(kp, f.name) for f in dataclasses.fields(kp)}
    return KindProfile(**{name: value[index] if isinstance(value, np.ndarray) else [value[i] for i in index]
                           for name, value in fields.items()})
