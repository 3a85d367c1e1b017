"""Finding the repeated blocks of a model: auto-detection (Hugging Face ``_no_split_modules``, alike children of a
``ModuleList``/``Sequential``, a composite class that repeats) and the explicit selectors of ``apply_checkpointing``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import nn

BlockPolicy = Literal["keep", "recompute", "offload"]


BlockSelector = None | type | tuple[type, ...] | Callable[[str, nn.Module], bool] | Sequence[str]


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _signature(module: nn.Module) -> Any:
    """A module's class; for containers, also the signatures of their children, in order (so that
    ``Sequential(Linear, GELU, Linear)`` blocks written without a class of their own compare equal)."""
    if isinstance(module, _CONTAINERS):
        return type(module), tuple((name, _signature(child)) for name, child in module.named_children())
    return type(module)


def _describe(module: nn.Module) -> str:
    """``Sequential(Linear, GELU)`` for containers, the class name otherwise: for error messages."""
    if isinstance(module, _CONTAINERS):
        inner = [_describe(child) for child in module.children()]
        return f"{type(module).__name__}({', '.join(inner[:4])}{', ...' if len(inner) > 4 else ''})"
    return type(module).__name__


def find_blocks(model: nn.Module) -> list[str]:
    """The qualified names of the repeated blocks ``apply_checkpointing(model)`` would wrap (also what FSDP2
    shards one by one): Hugging Face ``_no_split_modules``, else the children of a ModuleList/Sequential that are
    alike (one class, or structurally identical nn.Sequential blocks), else a composite class that repeats."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    if no_split:
        names = [
            name for name, m in model.named_modules()
            if name and any(cls.__name__ in no_split for cls in type(m).__mro__)
        ]
        names = _outermost(names)
        if names:
            return names

    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(children) >= 2:
            kinds = {_signature(child) for _, child in children}
            # A ModuleList or ModuleDict has no forward of its own: it cannot be a block.
            callable_kind = not isinstance(children[0][1], (nn.ModuleList, nn.ModuleDict))
            if len(kinds) == 1 and callable_kind and all(has_parameters(child) for _, child in children):
                found.extend(f"{prefix}{name}" for name, _ in children)
                return
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    if found:
        modules = dict(model.named_modules())
        kind = type(modules[found[0]])
        if issubclass(kind, _CONTAINERS) or next(modules[found[0]].children(), None) is None:
            # Leaf blocks (nn.Linear) or Sequential blocks: only the container's children. A head of the same
            # class outside it would recompute a matmul to save nothing; any other Sequential is no block.
            return found
        # Composite blocks of the same class outside such a container count too (ResNet: a stage of one block).
        return _outermost([name for name, m in modules.items() if name and type(m) is kind])
    # No container of repeated blocks: fall back to the composite module class that repeats most often
    # (e.g. ResNet stages of one BasicBlock each).
    counts: dict[type, list[str]] = {}
    for name, m in model.named_modules():
        if name and not isinstance(m, _CONTAINERS) and next(m.children(), None) is not None and has_parameters(m):
            counts.setdefault(type(m), []).append(name)
    repeated = [_outermost(names) for names in counts.values() if len(names) >= 2]
    return max(repeated, key=len, default=[])


def _no_blocks_problem(model: nn.Module) -> str:
    return (f"{no_blocks_found(model)}. To resolve this error, pass blocks= a module class, a list of module names, "
            "or a predicate (name, module) -> bool.")


def no_blocks_found(model: nn.Module) -> str:
    """What auto-detection looked for and what the model holds instead (no fix: callers differ in theirs)."""
    containers = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, (nn.Sequential, nn.ModuleList)) and len(m) >= 2]
    seen = ""
    if containers:
        name, largest = max(containers, key=lambda item: len(item[1]))
        where = f"container {name!r}" if name else "the model itself"
        seen = f" ({where} is the largest container; it holds {', '.join(_describe(c) for c in largest.children())})"
        if len(seen) > 300:
            seen = seen[:296] + "...)"
    return (
        f"no repeated blocks found in {type(model).__name__}: auto-detection looks for an nn.ModuleList or "
        "nn.Sequential of two or more modules with parameters that are alike (one class, or structurally "
        "identical nn.Sequential blocks), a module class with submodules that repeats, or Hugging Face "
        f"_no_split_modules, and found none{seen}"
    )


def _outermost(names: list[str]) -> list[str]:
    return [n for n in names if not any(n.startswith(other + ".") for other in names if other != n)]


def select_blocks(model: nn.Module, blocks: BlockSelector, problems: list[str]) -> list[str]:
    modules = dict(model.named_modules())
    if blocks is None:
        names = find_blocks(model)
        if not names:
            problems.append(_no_blocks_problem(model))
        return names
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)):
        names = [name for name, m in modules.items() if name and isinstance(m, blocks)]
        what = f"blocks={blocks!r}"
    elif callable(blocks):
        names = [name for name, m in modules.items() if name and blocks(name, m)]
        what = "the blocks predicate"
    elif isinstance(blocks, Sequence) and not isinstance(blocks, (str, bytes)) and all(
        isinstance(b, str) for b in blocks
    ):
        if not blocks:
            # Not "checkpoint nothing" (remove_checkpointing says that): an empty list is most often a filter that
            # matched nothing upstream, and wrapping nothing would hide it until the run runs out of memory.
            problems.append(f"blocks={blocks!r} selects no module. To resolve this error, pass the names of the "
                            "blocks to checkpoint, blocks=None to auto-detect them, or call "
                            "remove_checkpointing(model) for none.")
        unknown = [b for b in blocks if b not in modules or b == ""]
        for name in unknown:
            close = difflib.get_close_matches(name, list(modules), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            problems.append(
                f"blocks: {type(model).__name__} has no submodule named {name!r}.{hint} To resolve this error, "
                "pass qualified names as printed by model.named_modules()."
            )
        names = [b for b in dict.fromkeys(blocks) if b not in unknown]
        what = None
    else:
        problems.append(
            f"blocks={blocks!r} is not a module class, a tuple of classes, a predicate or a list of names. "
            "To resolve this error, pass one of those, or None to auto-detect the repeated blocks."
        )
        return []
    if what is not None and not names:
        candidates = find_blocks(model)[:3]
        hint = f" (auto-detection would pick {candidates} ...)" if candidates else ""
        problems.append(
            f"{what} matches no submodule of {type(model).__name__}{hint}. To resolve this error, pass a class "
            "or predicate that matches the blocks, or blocks=None to auto-detect them."
        )
    nested = [n for n in names if any(n.startswith(other + ".") for other in names if other != n)]
    if nested:
        problems.append(
            f"blocks selects modules nested inside other selected blocks ({nested[:3]}...): the inner ones would "
            "be recomputed twice. To resolve this error, select blocks that do not contain each other."
        )
    return names
