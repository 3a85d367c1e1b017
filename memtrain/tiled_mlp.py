"""Tiled MLP: each block's MLP computed over tiles of the tokens, never over the whole sequence at once.

Checkpointing bounds what a block keeps, not what it allocates inside: at long sequences the MLP's intermediate
(tokens x 3.5 x hidden, two or three of them in a gated MLP) sets the step's peak, in forward and again in the
recompute and backward. ``apply_tiled_mlp(model)`` runs each MLP ``tile_tokens`` tokens at a time (the hidden size
by default, as ALST's ``TiledMLP`` does): forward keeps only the MLP's input, and backward recomputes one tile at a
time, turning it into its gradients before the next. The cost is one more forward of the MLP (a block already
recomputed pays it once) and, in backward, a second copy of the MLP's weight gradients while a tile's are added in.

Each token's output and input gradient are computed exactly as untiled (the same rows of the same matmuls: bitwise
equal in fp32 on the CPU, ``tests/test_tiled_mlp.py``); the weight gradients are sums over the tiles, so they differ
from the untiled ones by rounding (the tolerance is stated in the tests). The recompute restores the random state
forward had (dropout draws the same masks) and the autocast forward ran under. A selective checkpoint around it
keeps none of its matmuls (``keeping_nothing``): it keeps only its input, which it recomputes from.

Example:
    >>> from memtrain.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16))
    >>> apply_tiled_mlp(model, tile_tokens=8)
    2
    >>> remove_tiled_mlp(model)
    True
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from memtrain.checkpointing import find_blocks
from memtrain.checkpointing.selective import keeping_nothing
from memtrain.errors import ConfigError, MemtrainError
from memtrain.message import arg
from memtrain.unwrap import unwrap_model

# A block's MLP by its attribute name (memtrain's GPT and the Hugging Face decoder layers name it so).
MLP_NAMES = ("mlp", "feed_forward", "ffn")
# What makes a module no position-wise MLP: routing tokens to experts (a token's output then depends on the others
# through capacity and load-balancing statistics), or mixing positions.
_NOT_POSITIONWISE = ("experts", "router", "conv", "attn", "attention")


def _autocast_states(x: torch.Tensor) -> list[dict[str, Any]]:
    """The autocast state forward runs under, for ``x``'s device and the CPU (a device without autocast, such as
    the estimator's meta tensors, has none: its rules wrap the recompute themselves)."""
    kinds = dict.fromkeys((x.device.type, "cpu"))
    return [{"device_type": kind, "enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind),
             "cache_enabled": torch.is_autocast_cache_enabled()}
            for kind in kinds if torch.amp.is_autocast_available(kind)]


class _TiledMLP(torch.autograd.Function):
    """``mlp(x)`` tile by tile over the rows of ``x`` (tokens x hidden): forward keeps ``x`` only; backward
    recomputes each tile under forward's random and autocast state and turns it into its gradients, adding the
    weights' over the tiles (one AccumulateGrad per weight and step: hooks on it fire once)."""

    @staticmethod
    def forward(ctx: Any, tiled: TiledForward, tile_tokens: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        # Forward's own weights (leaves: no cycle through the graph), so that backward's gradients are theirs
        ctx.tiled, ctx.tile_tokens, ctx.params = tiled, tile_tokens, params
        ctx.autocast = _autocast_states(x)
        ctx.random = _RandomState(x)
        ctx.save_for_backward(x)
        with keeping_nothing():
            outs = [tiled.positionwise(tile) for tile in x.split(tile_tokens)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = ctx.params
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        grads: list[torch.Tensor | None] = [None] * len(params)
        wanted = [i for i in range(len(params)) if ctx.needs_input_grad[3 + i]]
        # Tiles in forward's order from forward's random state: each draws what it drew then (dropout's masks).
        with ctx.random.restored():
            # The tiles' saved tensors are autograd's own, used at once below: no outer saved-tensors hook (an
            # activation offloader, a meter) takes them, as none takes what a checkpoint's recompute saves.
            with torch.enable_grad(), _kept_here(), contextlib.ExitStack() as stack:
                for state in ctx.autocast:
                    stack.enter_context(torch.autocast(**state))
                start = 0
                for tile, grad_tile in zip(x.split(ctx.tile_tokens), grad_out.split(ctx.tile_tokens), strict=True):
                    tile = tile.detach().requires_grad_(grad_x is not None)
                    out = ctx.tiled.positionwise(tile)
                    inputs = ([tile] if grad_x is not None else []) + [params[i] for i in wanted]
                    got = torch.autograd.grad(out, inputs, grad_tile, allow_unused=True)
                    del out
                    if grad_x is not None:
                        grad_x[start:start + tile.shape[0]] = got[0]
                        got = got[1:]
                    for i, g in zip(wanted, got, strict=True):
                        if g is None:
                            continue
                        if grads[i] is None:
                            # 16-bit gradients are summed in fp32, as one untiled matmul accumulates them, and
                            # rounded once at the end: adding bf16 tiles would round once per tile.
                            grads[i] = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
                        else:
                            grads[i].add_(g)  # type: ignore[union-attr]
                    start += tile.shape[0]
        grads = [g.to(p.dtype) if g is not None and g.dtype != p.dtype else g for g, p in zip(grads, params, strict=True)]
        return (None, None, grad_x, *grads)


class _RandomState:
    """The CPU generator's state and that of ``x``'s device where it has one, as forward began; ``restored()`` runs
    a stretch from it and then puts back the states it found. NOTE: the CPU's is a clone of the generator, not
    ``torch.get_rng_state()``'s tensor: nothing of it is allocated while the tiles' memory is (the estimator's
    figures and a measurement then agree to the byte)."""

    def __init__(self, x: torch.Tensor):
        self.cpu = torch.default_generator.clone_state()
        self.device_type = x.device.type
        self.devices, self.states = get_device_states(x)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        generator = torch.default_generator
        now = generator.clone_state()
        # fork_rng puts the devices' states back (on a device, its CPU copy of the CPU's state costs no device bytes)
        with torch.random.fork_rng(devices=self.devices, enabled=bool(self.devices), device_type=self.device_type):
            generator.set_state(self.cpu.get_state())
            if self.devices:
                set_device_states(self.devices, self.states, device_type=self.device_type)
            try:
                yield
            finally:
                generator.set_state(now.get_state())


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _kept_here() -> torch.autograd.graph.saved_tensors_hooks:
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


class TiledForward:
    """A module's forward, tiled: the instance attribute ``apply_tiled_mlp`` sets (``untiled``: the forward it
    replaces)."""

    def __init__(self, module: nn.Module, untiled: Callable[[torch.Tensor], torch.Tensor], had_instance_forward: bool,
                 tile_tokens: int | None):
        self.module, self.untiled = module, untiled
        self.had_instance_forward, self.tile_tokens = had_instance_forward, tile_tokens

    def trainable(self) -> list[nn.Parameter]:
        """The MLP's weights that get gradients (a LoRA model's adapters; not its frozen or quantized base)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def positionwise(self, tile: torch.Tensor) -> torch.Tensor:
        """The untiled forward of one tile, checked to give one output per token."""
        out = self.untiled(tile)
        if not isinstance(out, torch.Tensor) or out.shape[:-1] != tile.shape[:-1]:
            got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"shape {tuple(out.shape)}"
            raise MemtrainError(f"tiled MLP: {type(self.module).__name__} returned {got} for an input of shape "
                                f"{tuple(tile.shape)}; a tiled MLP must map each token to one output of its own. To "
                                f"resolve this error, pass {arg('tiled_mlp', False)} for this model (or "
                                "remove_tiled_mlp(model)).")
        return out

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            given = "more than one argument" if args or kwargs else (
                f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__)
            raise MemtrainError(f"tiled MLP: {type(self.module).__name__} was called with {given}; a tiled MLP takes "
                                f"one tensor of tokens x hidden alone. To resolve this error, pass "
                                f"{arg('tiled_mlp', False)} for this model (or remove_tiled_mlp(model)).")
        rows = x.reshape(-1, x.shape[-1])
        tile_tokens = self.tile_tokens or x.shape[-1]
        if not torch.is_grad_enabled() or rows.shape[0] <= tile_tokens:
            return self.untiled(x)  # evaluation, or one tile: nothing to save
        out = _TiledMLP.apply(self, tile_tokens, rows, *self.trainable())
        return out.reshape(*x.shape[:-1], out.shape[-1])


def tileable_mlps(model: nn.Module) -> list[str]:
    """The qualified names of the MLPs ``apply_tiled_mlp`` tiles: in each repeated block (``find_blocks``), the
    child named ``mlp`` (or ``feed_forward``, ``ffn``) that maps each token alone: no experts or router (a mixture
    of experts routes tokens by their batch's statistics), no attention or convolution."""
    model = unwrap_model(model, peft=True)
    modules = dict(model.named_modules())
    names = []
    for block in find_blocks(model):
        for attr in MLP_NAMES:
            name = f"{block}.{attr}"
            mlp = modules.get(name)
            if mlp is None:
                continue
            parts = {part.lower() for sub, _ in mlp.named_modules() for part in sub.split(".")}
            mixes = any(word in part for part in parts for word in _NOT_POSITIONWISE)
            if mixes or "moe" in type(mlp).__name__.lower() or not _takes_one_tensor(mlp):
                continue
            names.append(name)
            break
    return names


def _takes_one_tensor(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s forward takes one argument and nothing else: a forward with a residual (Bloom, MPT) or a
    state (RWKV's time-shifting feed-forward) is not a map of each token alone."""
    forward = mlp.__dict__.get("forward")
    forward = forward.untiled if isinstance(forward, TiledForward) else mlp.forward  # tiled already: its own
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)


def mlp_width(model: nn.Module) -> int | None:
    """The input width of ``model``'s first MLP to tile (its hidden size: a tile's tokens by default), or None where
    it has none."""
    modules = dict(unwrap_model(model, peft=True).named_modules())
    for name in tileable_mlps(model):
        for m in modules[name].modules():
            # nn.Linear's in_features; transformers' Conv1D (GPT-2) names it nx
            width = getattr(m, "in_features", None) or getattr(m, "nx", None)
            if isinstance(width, int) and width > 0:
                return width
    return None


def supports_tiled_mlp(model: nn.Module) -> bool:
    """Whether ``apply_tiled_mlp`` finds an MLP to tile in ``model``."""
    return bool(tileable_mlps(model))


def apply_tiled_mlp(model: nn.Module, *, tile_tokens: int | None = None) -> int:
    """Computes each block's MLP ``tile_tokens`` tokens at a time (``tileable_mlps``); returns how many MLPs.

    The MLP's intermediate then never exists for more than one tile, in forward or backward: on a Llama at 8,192
    tokens a checkpointed block's step peaks at less than half the untiled one (``tests/test_tiled_mlp.py``). The
    cost: one more forward of the MLP, and a second copy of its weight gradients in backward. Calling again changes
    ``tile_tokens``; ``remove_tiled_mlp(model)`` undoes it. Evaluation (gradients off) runs the MLP whole.

    Args:
        model: memtrain's ``GPT``, a Hugging Face decoder, or any model whose repeated blocks have an ``mlp``.
        tile_tokens: tokens per tile; None: the MLP's input width (the hidden size), as ALST's ``TiledMLP``.

    Raises:
        ConfigError: a bad ``tile_tokens``, or a model with no MLP to tile.
    """
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int)
                                    or tile_tokens < 1):
        raise ConfigError(f"tile_tokens={tile_tokens!r} must be an integer >= 1 or None. To resolve this error, pass "
                          "e.g. tile_tokens=4096, or None for the hidden size.")
    names = tileable_mlps(model)
    if not names:
        raise ConfigError(f"apply_tiled_mlp: {type(unwrap_model(model, peft=True)).__name__} has no repeated block "
                          f"with a position-wise MLP (a child named {' / '.join(MLP_NAMES)} whose forward takes one "
                          f"tensor, no experts) to tile. To resolve this error, tile no MLP of this model "
                          f"({arg('tiled_mlp', False)}).")
    remove_tiled_mlp(model)
    modules = dict(unwrap_model(model, peft=True).named_modules())
    for name in names:
        mlp = modules[name]
        had = "forward" in mlp.__dict__
        mlp.forward = TiledForward(mlp, mlp.forward, had, tile_tokens)  # type: ignore[method-assign]
    return len(names)


def remove_tiled_mlp(model: nn.Module) -> bool:
    """Undoes ``apply_tiled_mlp``; returns whether there was anything to undo."""
    undone = False
    for mlp in unwrap_model(model, peft=True).modules():
        forward = mlp.__dict__.get("forward")
        if isinstance(forward, TiledForward):
            if forward.had_instance_forward:
                mlp.forward = forward.untiled  # type: ignore[method-assign]
            else:
                del mlp.forward
            undone = True
    return undone


def tiled_mlp_tokens(model: nn.Module) -> int | None:
    """The tile size of ``model``'s tiled MLPs (0: the hidden size), or None where none is tiled."""
    for mlp in unwrap_model(model, peft=True).modules():
        forward = mlp.__dict__.get("forward")
        if isinstance(forward, TiledForward):
            return forward.tile_tokens or 0
    return None
