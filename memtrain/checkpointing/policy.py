"""``Checkpointing``: the one typed value naming a checkpointing policy, its spellings (none / all / every:K /
selective(...) / blocks(RKO...), a layout's recomputed blocks optionally +selective(...), each with an optional
+offload) and what it does to a model."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch import nn

from memtrain.checkpointing.blocks import BlockPolicy, find_blocks, no_blocks_found
from memtrain.checkpointing.selective import SelectivePolicy, resolve_selective
from memtrain.checkpointing.wrap import apply_checkpointing, remove_checkpointing
from memtrain.errors import ConfigError
from memtrain.message import arg, words
from memtrain.offload import ActivationOffloader

CheckpointingMode = Literal["none", "all", "every", "selective", "blocks"]

_LETTERS: dict[BlockPolicy, str] = {"recompute": "R", "keep": "K", "offload": "O"}
_SPELLINGS = ("'none', 'all', 'every:K' (K >= 1), 'selective' or e.g. 'selective(matmul,attention)', "
              "'blocks(RKO...)' (a letter per block: R recompute, K keep, O offload; '+selective' after it "
              "recomputes the R blocks selectively), each optionally followed by '+offload' (the recomputed blocks' "
              "inputs in host memory)"
              # Python's spellings only: the command line's flag and --config file take the text ones.
              + words("; an integer K (every:K); True (all); False or None (none); or a Checkpointing", ""))


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


@dataclass(frozen=True)
class Checkpointing:
    """Which blocks recompute in backward, which keep their activations, which offload them.

    A recomputed block costs about one extra forward of it and keeps only its input; a kept block costs no time
    and keeps every activation; an offloaded block keeps them in pinned host memory (PCIe traffic instead of
    compute). One typed value for every place that names a policy: ``parse`` reads each accepted spelling,
    ``str`` writes one that ``parse`` reads back, ``apply`` configures a model, ``block_policies`` says what each
    block does (for the planner and the estimator).

    Args:
        mode: "none" (no block recomputes), "all", "every" (one block in ``every``), "selective" (every block,
            keeping the outputs of the op kinds in ``selective``), "blocks" (one policy per block: ``blocks``).
        every: with mode="every": blocks 0, every, 2*every, ... recompute, the others keep.
        selective: with mode="selective": the op kinds kept (default ``SelectivePolicy()``: matmul, attention); with
            mode="blocks": the recomputed blocks recompute selectively, keeping these (None: they recompute whole).
        blocks: with mode="blocks": "keep" / "recompute" / "offload" for each detected block, in order.
        offload_inputs: the recomputed blocks' saved inputs wait in pinned host memory (a no-op without CUDA).

    Raises:
        ConfigError: every problem of the combination at once (an unknown mode, ``every < 1``, a field given for
            another mode, unknown op kinds or block policies, ``offload_inputs`` with mode="none").

    Example:
        >>> Checkpointing.parse("every:2")
        Checkpointing(mode='every', every=2, selective=None, blocks=(), offload_inputs=False)
        >>> str(Checkpointing(mode="blocks", blocks=("recompute", "keep", "offload")))
        'blocks(RKO)'
        >>> Checkpointing.parse("all+offload").block_policies(3)
        ('recompute', 'recompute', 'recompute')
        >>> str(Checkpointing.parse("blocks(RRK)+selective"))
        'blocks(RRK)+selective(matmul,attention)'
    """

    mode: CheckpointingMode = "all"
    every: int = 1
    selective: SelectivePolicy | None = None
    blocks: tuple[BlockPolicy, ...] = ()
    offload_inputs: bool = False

    def __post_init__(self) -> None:
        problems: list[str] = []
        modes = get_args(CheckpointingMode)
        if self.mode not in modes:
            problems.append(f"mode={self.mode!r} is not a checkpointing mode. To resolve this error, use one of "
                            f"{list(modes)}.")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            problems.append(f"every={self.every!r}: it must be an integer >= 1. To resolve this error, pass e.g. "
                            "every=2 (one block in two recomputes).")
        elif self.every != 1 and self.mode != "every":
            problems.append(f"every={self.every} applies only with mode='every', not mode={self.mode!r}. To "
                            "resolve this error, pass mode='every', or leave every at 1.")
        selective = self.selective
        if selective is not None:
            if self.mode not in ("selective", "blocks"):
                problems.append(f"selective={selective!r} applies only with mode='selective' (or 'blocks': its "
                                f"recomputed blocks), not mode={self.mode!r}. To resolve this error, pass "
                                "mode='selective' or selective=None.")
            selective = resolve_selective(selective, problems)
            if selective is not None:  # a hashable policy: SelectivePolicy(keep=[...]) holds a list
                selective = SelectivePolicy(keep=tuple(selective.keep))
        elif self.mode == "selective":
            selective = SelectivePolicy()  # the documented default: keep matmul and attention outputs
        object.__setattr__(self, "selective", selective)
        blocks = self.blocks
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
            problems.append(f"blocks={blocks!r}: it must be a sequence of block policies. To resolve this "
                            "error, pass e.g. blocks=('recompute', 'keep', 'offload').")
            blocks = ()
        blocks = tuple(blocks)
        object.__setattr__(self, "blocks", blocks)
        unknown = [b for b in blocks if b not in _LETTERS]
        if unknown:
            problems.append(f"blocks: unknown block policies {unknown}. To resolve this error, use "
                            f"{list(get_args(BlockPolicy))}.")
        if self.mode == "blocks" and not blocks:
            problems.append("mode='blocks' needs one policy per block, and blocks=() gives none. To resolve this "
                            "error, pass e.g. blocks=('recompute', 'recompute', 'keep') (spelled 'blocks(RRK)': a "
                            "letter per block, R recompute, K keep, O offload), or another mode.")
        elif self.mode == "blocks" and selective is not None and "recompute" not in blocks:
            problems.append(f"checkpointing blocks({''.join(_LETTERS.get(b, '?') for b in blocks)}) with selective: "
                            "no block recomputes (no R), so nothing recomputes selectively. To resolve this error, "
                            "drop +selective, or make some blocks R.")
        elif self.mode != "blocks" and blocks:
            problems.append(f"blocks={blocks!r} applies only with mode='blocks', not mode={self.mode!r}. To "
                            "resolve this error, pass mode='blocks' or blocks=().")
        if not isinstance(self.offload_inputs, bool):
            problems.append(f"offload_inputs={self.offload_inputs!r}: it must be True or False. To resolve this "
                            "error, pass offload_inputs=True or False.")
        elif self.offload_inputs and self.mode == "none":
            problems.append("offload_inputs=True with mode='none': no block recomputes, so no block input is "
                            "saved alone to offload. To resolve this error, pass a mode that recomputes, or wrap "
                            "the whole forward in offload_activations(model=...).")
        ConfigError.raise_if(problems)

    @classmethod
    def parse(cls, value: Any) -> Checkpointing:
        """The policy a CLI flag, a config file or an argument names (see the class docstring's spellings).

        Raises:
            ConfigError: a value that is none of the accepted spellings, or a bad combination.
        """
        if isinstance(value, Checkpointing):
            return value
        if value is None or value is False:
            return cls(mode="none")
        if value is True:
            return cls(mode="all")
        if isinstance(value, int):
            if value >= 1:
                return cls(mode="every", every=value)
            raise ConfigError(f"{arg('checkpointing', value)}: an integer K means every:K, so it must be >= 1. To "
                              f"resolve this error, pass one of {_SPELLINGS}.")
        if isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            offload = text.endswith("+offload")
            text = text.removesuffix("+offload")
            if text in ("none", "all"):
                return cls(mode=text, offload_inputs=offload)  # type: ignore[arg-type]
            if match := re.fullmatch(r"every:(\d+)", text):
                if int(match[1]) < 1:  # in the spelling given, not as the field every= (the CLI takes this one)
                    raise ConfigError(f"{arg('checkpointing', value)}: every:K recomputes one block in K, so K must be an "
                                      "integer >= 1. To resolve this error, pass e.g. 'every:2' (one block in two "
                                      "recomputes).")
                return cls(mode="every", every=int(match[1]), offload_inputs=offload)
            if match := re.fullmatch(r"selective(?:\(([a-z_,]*)\))?", text):
                keep = tuple(match[1].split(",")) if match[1] is not None else None
                return cls(mode="selective", offload_inputs=offload,
                           selective=SelectivePolicy(keep=keep) if keep is not None else None)  # type: ignore[arg-type]
            if match := re.fullmatch(r"blocks\(([rko]+)\)(\+selective(?:\(([a-z_,]*)\))?)?", text):
                by_letter = {letter.lower(): policy for policy, letter in _LETTERS.items()}
                keep = tuple(match[3].split(",")) if match[3] is not None else None
                selective = None if match[2] is None else SelectivePolicy(keep=keep) if keep else SelectivePolicy()
                return cls(mode="blocks", blocks=tuple(by_letter[c] for c in match[1]), selective=selective,
                           offload_inputs=offload)
            if match := re.fullmatch(r"blocks(?:\((.*)\))?", text):
                others = sorted(set(match[1] or "") - set("rko"))
                what = (f"{', '.join(map(repr, others))} {'is not a block letter' if len(others) == 1 else 'are not block letters'}"
                        if others else "it names no block")
                raise ConfigError(f"{arg('checkpointing', value)}: {what}; a block layout takes a letter per block (R "
                                  "recompute, K keep, O offload), in the order find_blocks(model) returns them. To "
                                  "resolve this error, pass e.g. 'blocks(RRK)' for three blocks, or another policy.")
            if text == "auto":
                raise ConfigError(f"{arg('checkpointing', 'auto')} is not a policy but a request that the planner choose "
                                  "one. To resolve this error, let memtrain's planner resolve 'auto' (train does) "
                                  f"and parse its choice, or pass one of {_SPELLINGS}.")
        raise ConfigError(f"{arg('checkpointing', value)} is not a checkpointing policy. To resolve this error, pass "
                          f"one of {_SPELLINGS}.")

    def __str__(self) -> str:
        if self.mode == "every":
            text = f"every:{self.every}"
        elif self.mode == "selective":
            text = f"selective({','.join(self.selective.keep)})"  # type: ignore[union-attr]
        elif self.mode == "blocks":
            text = f"blocks({''.join(_LETTERS[b] for b in self.blocks)})"
            if self.selective is not None:
                text += f"+selective({','.join(self.selective.keep)})"
        else:
            text = self.mode
        return text + ("+offload" if self.offload_inputs else "")

    def block_policies(self, n_blocks: int) -> tuple[BlockPolicy, ...]:
        """What each of ``n_blocks`` blocks does: "keep", "recompute" (selective ones included) or "offload"."""
        if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
            raise ConfigError(f"n_blocks={n_blocks!r}: it must be an integer >= 0 (the number of blocks). To resolve "
                              "this error, pass len(find_blocks(model)).")
        if self.mode == "none":
            return ("keep",) * n_blocks
        if self.mode == "every":
            return tuple("recompute" if i % self.every == 0 else "keep" for i in range(n_blocks))
        if self.mode == "blocks":
            if len(self.blocks) != n_blocks:
                raise ConfigError(f"checkpointing {self} names {_blocks(len(self.blocks))}, not {n_blocks}. To "
                                  "resolve this error, give one policy per block, in the model's order.")
            return self.blocks
        return ("recompute",) * n_blocks

    def apply(self, model: nn.Module, *, offloader: ActivationOffloader | None = None) -> list[str]:
        """Checkpoints ``model`` in place by this policy (through ``apply_checkpointing``; "none" removes any
        checkpointing) and returns the qualified names of the wrapped blocks.

        Raises:
            ConfigError: as ``apply_checkpointing``; mode="blocks" with a policy count that is not the number
                of blocks ``find_blocks(model)`` detects.
        """
        kwargs = self.arguments(model)
        if kwargs is None:
            remove_checkpointing(model)
            return []
        return apply_checkpointing(model, **kwargs, offloader=offloader)

    def arguments(self, model: nn.Module) -> dict[str, Any] | None:
        """``apply_checkpointing``'s keyword arguments for this policy on ``model`` (None for mode="none").

        Raises:
            ConfigError: mode="blocks" with a policy count that is not the number of blocks of ``model``.
        """
        if self.mode == "none":
            return None
        kwargs: dict[str, Any] = {"offload": self.offload_inputs}
        if self.mode == "every":
            kwargs["every"] = self.every
        elif self.mode == "selective":
            kwargs["selective"] = self.selective
        elif self.mode == "blocks":
            if not isinstance(model, nn.Module):
                raise ConfigError(f"checkpointing {self}: model is a {type(model).__name__}, not an nn.Module. To "
                                  "resolve this error, pass the model whose blocks the letters name.")
            names = find_blocks(model)
            if not names:
                raise ConfigError(f"checkpointing {self} gives one policy per detected block, but "
                                  f"{no_blocks_found(model)}. To resolve this error, name the blocks with "
                                  "apply_checkpointing(model, blocks=[...], policies={name: policy}), or pass "
                                  f"{arg('checkpointing', 'none')}.")
            if len(names) != len(self.blocks):
                raise ConfigError(
                    f"{arg('checkpointing', str(self))} names {_blocks(len(self.blocks))}, but "
                    f"{type(model).__name__} has {len(names)} ({names[0]} ... {names[-1]}). To resolve this error, "
                    "give one " + words("policy per block, in the order find_blocks(model) returns them",
                                        f"letter per block, {len(names)} in all (R recompute, K keep, O offload)") + "."
                )
            kwargs["policies"] = dict(zip(names, self.blocks, strict=True))
            kwargs["selective"] = self.selective
        return kwargs
