"""Where the traced step is, and what each place holds: the block (or top-level module) running now, the saved
storages of each block and run, and the forward's cast cache booked to the runs that made it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves

from memtrain.checkpointing import find_blocks
from memtrain.estimate.tracker import LiveTracker
from memtrain.measure import MemoryMeter, storage_key


# -- where are we -------------------------------------------------------------------------------------------
class Where:
    """The block (or top-level module) running now: a stack in forward, autograd node labels in backward."""

    def __init__(self, model: nn.Module):
        names = {id(m): name for name, m in model.named_modules()}
        blocks = find_blocks(model)
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

    def __enter__(self) -> Where:
        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


class BlockMeter(MemoryMeter):
    """``MemoryMeter`` that also attributes each saved storage to the block (and the run) that saved it."""

    def __init__(self, model: nn.Module, where: Where, tracker: LiveTracker):
        super().__init__(model)
        self.where = where
        self.tracker = tracker
        self.per_block: dict[str, int] = {}

    def _count(self, t: torch.Tensor) -> None:
        if self._is_model_state(t):
            return
        key, nbytes = storage_key(t)
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


def attribute_release(tracker: LiveTracker, before: dict[int, tuple[int, tuple[Any, ...], int]]) -> None:
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
