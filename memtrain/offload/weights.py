"""Parameter offload: the repeated blocks' weights live in host memory and reach the device one block ahead of use.

Trade-off: the device holds the non-block parameters and only ``1 + prefetch`` blocks' weights at a time (a 13B's
26 GB of bf16 weights become about two blocks' 0.6 GB), for two host->device copies of every block weight per
micro-batch (forward, and again in backward, where the recompute of a checkpointed block reuses the copy its
backward brought), overlapped with compute on a side stream.

How it works (the FSDP2 pattern, on one rank and without sharding):

- each block parameter keeps its ``nn.Parameter`` object. At rest its ``.data`` is the host copy (pinned where the
  device has streams: the offloaded optimizer's fp32 master or its bf16 cast, or a view of the streamer's own
  exact-size slab); in use it is a device tensor of its own whose storage is resized to zero when the block is
  released, so that the views autograd saved of it (``W.t()`` of a linear) free their memory too and see the
  weights again when the storage is refilled for backward;
- a forward pre-hook makes the block resident (waiting for its copy) and starts the copies of the next
  ``prefetch`` blocks; a forward post-hook releases it;
- a hook on the block's outputs fires when their gradient is ready, just before the block's backward (and the
  recompute of a checkpointed block, which runs inside it): the block is made resident again and the previous
  ``prefetch`` blocks start copying; an identity autograd function on the block's inputs runs after the block's
  backward and releases it (an end-of-backward callback releases anything left);
- gradients are autograd's, on the device; ``CPUOffloadOptimizer`` streams them to the host as they are
  accumulated and steps the host master, which is the copy the next forward reads (``stream_weights``); before
  its CPU step overwrites those host weights it waits for the event ``fills_done()`` returns: every copy reading
  them is done.

Streams (FSDP2's pattern, ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``): a block's device storage
is allocated on the compute stream, so the caching allocator reuses it in compute-stream order and no
``record_stream`` is needed (a side-stream allocation freed after ``record_stream(compute)`` cannot be reused until
the compute stream passes the free, and reserved memory grows toward every block); the side stream waits for an
event recorded on the compute stream at that point (the memory may be what compute's earlier kernels still read),
copies, and records the event the compute stream waits for before the block is used.

On a CPU-only machine the "device" is the CPU: the same code runs with plain copies and no stream, and the
counters (resident bytes, blocks in flight, bytes over the link) are what a test asserts; on the simulated
accelerator (``memtrain.device.simulate``) it runs with its streams, events and memory ledger.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from memtrain.device import Accelerator, accelerator
from memtrain.errors import ConfigError, MemtrainError

PREFETCH_DEFAULT = 1  # blocks whose copies run ahead of the one in use: 1 + prefetch blocks on the device at most
_STREAMED_ATTR = "_memtrain_streamed"  # set on a block module while a streamer holds its weights


@dataclass(eq=False)
class _Weight:
    """One streamed parameter: the parameter, its device tensor (storage resized 0 <-> full) and its host copy."""

    param: nn.Parameter
    device: torch.Tensor
    host: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.device.numel() * self.device.element_size()


@dataclass(eq=False)
class _Block:
    name: str
    module: nn.Module
    weights: list[_Weight]
    resident: bool = False
    event: Any = None  # the copy's event, until the compute stream waited for it
    backward_done: bool = False  # released by its post-backward in this backward

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)


@dataclass
class WeightStats:
    """What the streamer did: bytes and blocks on the device now and at most, bytes copied host -> device."""

    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    resident_blocks: int = 0
    peak_resident_blocks: int = 0
    link_bytes: dict[str, int] = field(default_factory=lambda: {"host_to_device": 0})
    fills: int = 0

    def reset_peaks(self) -> None:
        self.peak_resident_bytes = self.resident_bytes
        self.peak_resident_blocks = self.resident_blocks


class WeightStreamer:
    """Streams the blocks' weights from host memory to the device, ``prefetch`` blocks ahead of use.

    Trade-off: device bytes of ``1 + prefetch`` blocks' weights instead of all of them, for two host->device copies
    of the block weights per micro-batch (forward and backward), overlapped with compute on a side stream.

    Args:
        model: the model, on its training device; the blocks' weights may be on the device or in host memory (never
            placed: ``apply_plan`` leaves them there, so they are never whole on the device).
        blocks: the qualified names of the blocks to stream, in forward order (e.g.
            ``memtrain.checkpointing.find_blocks(model)``).
        prefetch: blocks copied ahead of the one in use (>= 0; 0 copies each block when it is reached).
        device: the training device (default: where the model's first parameter is).
        host_weights: ``id(parameter)`` -> the host tensor holding its weights in the device dtype (e.g.
            ``CPUOffloadOptimizer.stream_weights``: its fp32 master or bf16 cast, so that an optimizer step is what
            the next forward reads); parameters not in it get a host copy of their own: views of one exact-size
            slab, pinned where the device has streams (``Accelerator.host_buffer``).

    Raises:
        ConfigError: no blocks, a negative prefetch, a block parameter shared with another block or with the rest of
            the model (tied weights), or a host tensor of another shape or dtype.

    Example:
        >>> streamer = WeightStreamer(model, blocks=find_blocks(model), prefetch=1)
        >>> model(x).sum().backward()  # each block's weights reach the device just before use
        >>> streamer.stats.peak_resident_blocks  # 2
        >>> streamer.close()  # the parameters are device tensors again
    """

    def __init__(self, model: nn.Module, *, blocks: Sequence[str], prefetch: int = PREFETCH_DEFAULT,
                 device: torch.device | str | None = None, host_weights: dict[int, torch.Tensor] | None = None):
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ConfigError(f"WeightStreamer(prefetch={prefetch!r}): the blocks copied ahead of use must be an "
                              "integer >= 0. To resolve this error, pass e.g. prefetch=1.")
        names = list(blocks)
        if not names:
            raise ConfigError(f"WeightStreamer: {type(model).__name__} has no repeated blocks to stream. To resolve "
                              "this error, pass blocks=[...] naming them, or train without parameter offload.")
        modules = dict(model.named_modules())
        _check_blocks(model, modules, names)
        self.model = model
        self.prefetch = prefetch
        self.acc: Accelerator = accelerator(device if device is not None else next(model.parameters()).device)
        self.device = self.acc.device
        self.stream = self.acc.new_stream() if self.acc.has_streams else None  # the copies' side stream
        self.stats = WeightStats()
        params = {n: list(modules[n].parameters()) for n in names}
        # host_slab: the streamer's own host copies (of the parameters not in host_weights), one view each.
        hosts, self.host_slab = _host_copies([p for n in names for p in params[n]], host_weights or {}, self.acc)
        self.blocks = [_Block(n, modules[n], [self._weight(p, hosts[id(p)]) for p in params[n]]) for n in names]
        for block in self.blocks:
            setattr(block.module, _STREAMED_ATTR, True)
        self._task: int | None = None  # the backward (autograd graph task) whose blocks were last brought back
        self._last_fill: Any = None  # the event after the last fill's copies (fills_done)
        self._handles = [h for i, b in enumerate(self.blocks) for h in self._register(i, b.module)]

    # -- set-up ---------------------------------------------------------------------------------------------
    def _weight(self, p: nn.Parameter, host: torch.Tensor) -> _Weight:
        # Through the seam, whether the weights are on the device now or were never placed (apply_plan leaves them
        # on the host): a simulated device's ledger then counts the block whenever it is filled.
        device = self.acc.empty(tuple(p.shape), p.dtype)
        self.acc.resize_storage(device, 0)  # no device bytes until the block is used
        p.data = host  # NOTE: the device copy of the weights is gone; the parameter now reads the host copy
        return _Weight(p, device, host)

    def _register(self, index: int, module: nn.Module) -> list[Any]:
        return [module.register_forward_pre_hook(self._pre_forward(index), with_kwargs=True),
                module.register_forward_hook(self._post_forward(index))]

    # -- residency ------------------------------------------------------------------------------------------
    def _fill(self, block: _Block) -> None:
        """Starts the host -> device copies of ``block`` (on the side stream where the device has streams)."""
        if block.resident:
            return
        acc = self.acc
        # Allocated on the compute stream (the caller's): the allocator then reuses the memory in compute-stream
        # order, and no record_stream is needed when the block is released.
        for w in block.weights:
            acc.resize_storage(w.device, w.nbytes)
        dsts, srcs = [w.device for w in block.weights], [w.host for w in block.weights]
        if self.stream is None:
            acc.foreach_copy_(dsts, srcs)
        else:
            # The memory may be what compute's earlier kernels still read: the side stream starts once the compute
            # stream reached this point (a device-side wait; the host goes on).
            acc.wait_event(acc.record_event(), stream=self.stream)
            acc.foreach_copy_(dsts, srcs, stream=self.stream)
            block.event = self._last_fill = acc.record_event(self.stream)
        for w in block.weights:
            # The parameter's TensorImpl keeps its version counter: the copy above bumped the device tensor's, not
            # the one autograd checks for the views it saved of the parameter.
            w.param.data = w.device
        block.resident = True
        self.stats.link_bytes["host_to_device"] += block.nbytes
        self.stats.fills += 1
        self.stats.resident_bytes += block.nbytes
        self.stats.resident_blocks += 1
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)
        self.stats.peak_resident_blocks = max(self.stats.peak_resident_blocks, self.stats.resident_blocks)

    def _use(self, block: _Block) -> None:
        """Makes ``block`` resident and orders the compute stream after its copies (no host wait)."""
        self._fill(block)
        self._wait_fill(block)

    def _wait_fill(self, block: _Block) -> None:
        if block.event is not None:
            self.acc.wait_event(block.event)
            block.event = None

    def _release(self, block: _Block) -> None:
        if not block.resident:
            return
        # A prefetched block released unused (an interrupted step): the compute stream, which reuses the memory
        # once it is freed, first waits for the copy still writing it.
        self._wait_fill(block)
        for w in block.weights:
            w.param.data = w.host
            # Every view autograd saved of the weights shares this storage: resizing frees their bytes as well.
            self.acc.resize_storage(w.device, 0)
        block.resident = False
        self.stats.resident_bytes -= block.nbytes
        self.stats.resident_blocks -= 1

    def fills_done(self) -> Any:
        """The event after every host -> device copy issued so far (they run in order on one side stream), or None
        where none can be in flight (no fill yet, or no streams).

        Whoever overwrites the host weights waits for it first (``acc.synchronize_event``): the offloaded
        optimizer's CPU step (``CPUOffloadOptimizer.stream_weights(..., fills_done=streamer.fills_done)``). Cheap
        at step time, where backward has used every block, so the copies are done; without it the step would race a
        copy still reading the weights it overwrites (a forward interrupted after a prefetch).
        """
        return self._last_fill

    def _prefetch(self, index: int, direction: int) -> None:
        for j in range(index + direction, index + direction * (self.prefetch + 1), direction):
            if 0 <= j < len(self.blocks):
                self._fill(self.blocks[j])

    def release_all(self) -> None:
        """Releases every block (e.g. after a forward whose backward never runs)."""
        for block in self.blocks:
            self._release(block)

    # -- hooks ----------------------------------------------------------------------------------------------
    def _pre_forward(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            block = self.blocks[index]
            if _in_backward():  # a forward inside backward (a hand-made recompute): the weights stay for it
                self._use(block)
                return None
            if index == 0:
                # A new forward: what an interrupted step left on the device (an out-of-memory error in
                # backward) goes back first.
                for other in self.blocks[1:]:
                    self._release(other)
            self._use(block)
            self._prefetch(index, +1)
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            grads = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not grads:
                return None
            # After the block's backward (autograd runs this once every input gradient is ready): release it.
            outs = _AfterBackward.apply(self, index, *[flat[i] for i in grads])
            for i, t in zip(grads, outs, strict=True):
                flat[i] = t
            return tree_unflatten(flat, spec)
        return hook

    def _post_forward(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if _in_backward():
                return
            self._release(self.blocks[index])
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in tensors:
                    t.register_hook(self._pre_backward_hook(index))
        return hook

    def _pre_backward_hook(self, index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if task != self._task:  # this backward's first block (an interrupted one's flags are stale)
                self._task = task
                for block in self.blocks:
                    block.backward_done = False
                # Once this backward ends: every block back to the host, and the next forward is a forward.
                # NOTE: autograd's engine callback, as FSDP uses it: no public API runs code at a backward's end.
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            block = self.blocks[index]
            if block.backward_done:
                return
            for later in self.blocks[index + 1:]:
                self._release(later)  # a later block whose inputs took no gradient: its backward is over
            self._use(block)
            self._prefetch(index, -1)
        return hook

    def _after_backward(self, index: int) -> None:
        block = self.blocks[index]
        block.backward_done = True
        self._release(block)

    def _end_backward(self) -> None:
        self._task = None
        self.release_all()

    # -- saving and closing ---------------------------------------------------------------------------------
    @contextmanager
    def on_device(self) -> Iterator[None]:
        """Every block resident for the duration (e.g. to compare with plain training); released after."""
        for block in self.blocks:
            self._use(block)
        try:
            yield
        finally:
            self.release_all()

    def close(self) -> None:
        """Removes the hooks and gives every parameter its device tensor back (all blocks' bytes on the device)."""
        if _in_backward():
            raise MemtrainError("WeightStreamer.close() during backward. To resolve this error, close it after the "
                                "step.")
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for block in self.blocks:
            self._use(block)
            delattr(block.module, _STREAMED_ATTR)
        self.blocks = []


def _host_copies(params: list[nn.Parameter], given: dict[int, torch.Tensor],
                 acc: Accelerator) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The host tensor of each parameter (the one ``given``, else a view of one slab holding every other
    parameter's weights) and that slab (bytes). One exact-size pinned buffer: a pinned allocation per parameter
    would be rounded up to a power of two each."""
    for p in params:
        host = given.get(id(p))
        if host is not None and (host.shape != p.shape or host.dtype != p.dtype or host.device.type != "cpu"):
            raise ConfigError(f"WeightStreamer: the host copy of a parameter of shape {tuple(p.shape)} is "
                              f"{tuple(host.shape)} {host.dtype} on {host.device}, not the parameter's {p.dtype} on "
                              "the host. To resolve this error, pass host tensors in the parameter's shape and dtype.")
    own = [p for p in params if id(p) not in given]
    # Widest elements first: every view then starts at a multiple of its element size, with no padding.
    own.sort(key=lambda p: -p.element_size())
    total = sum(p.numel() * p.element_size() for p in own)
    slab = acc.host_buffer(total, torch.uint8) if acc.has_streams else torch.empty(total, dtype=torch.uint8)
    hosts = dict(given)
    at = 0
    for p in own:
        n = p.numel() * p.element_size()
        host = slab[at:at + n].view(p.dtype).view(p.shape)
        host.copy_(p.detach())
        hosts[id(p)] = host
        at += n
    return hosts, slab


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recompute runs forwards there)."""
    # NOTE: torch.utils.checkpoint asks the same private function.
    return torch._C._current_graph_task_id() != -1


class _AfterBackward(torch.autograd.Function):
    """Identity on a block's inputs; its backward runs once the block's backward is done and releases it."""

    @staticmethod
    def forward(ctx: Any, streamer: WeightStreamer, index: int, *inputs: torch.Tensor) -> Any:
        ctx.streamer, ctx.index = streamer, index
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.streamer._after_backward(ctx.index)
        return (None, None, *grads)


def _check_blocks(model: nn.Module, modules: dict[str, nn.Module], names: list[str]) -> None:
    """ConfigError for blocks that cannot stream: an unknown name, a block streamed already, a parameter of a
    subclass (a quantised weight's own storage scheme), a parameter tied to another block or the rest of the model."""
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ConfigError(f"WeightStreamer: {type(model).__name__} has no modules {unknown[:3]}. To resolve this "
                          "error, pass the blocks' qualified names (memtrain.checkpointing.find_blocks(model)).")
    blocks = [modules[n] for n in names]
    if any(getattr(b, _STREAMED_ATTR, False) for b in blocks):
        raise ConfigError("WeightStreamer: these blocks are streamed already. To resolve this error, close() the "
                          "first streamer, or keep using it.")
    odd = sorted({type(p).__name__ for b in blocks for p in b.parameters() if type(p) is not nn.Parameter})
    if odd:
        raise ConfigError(f"WeightStreamer: the blocks hold parameters of type {', '.join(odd)} (e.g. quantised "
                          "weights), whose storage parameter offload cannot move. To resolve this error, train "
                          "without parameter offload (or without quantised base weights).")
    _check_unshared(model, blocks)


def _check_unshared(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Refuses a block parameter that another block or the rest of the model also uses (tied weights): it would be
    released under the other user's feet."""
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            if owner.setdefault(id(p), i) != i:
                raise ConfigError(f"WeightStreamer: a parameter of shape {tuple(p.shape)} is shared by blocks "
                                  f"{owner[id(p)]} and {i}. To resolve this error, untie it, or train without "
                                  "parameter offload.")
    prefixes = tuple(f"{n}." for n in _block_prefixes(model, blocks))
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owner and not name.startswith(prefixes):
            raise ConfigError(f"WeightStreamer: {name!r} is a block's parameter used outside the blocks (tied). To "
                              "resolve this error, untie it, or train without parameter offload.")


def _block_prefixes(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    ids = {id(b) for b in blocks}
    return [n for n, m in model.named_modules(remove_duplicate=False) if id(m) in ids]
