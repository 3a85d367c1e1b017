"""What a plan is made of: ``PlanSettings`` (one set-up), ``Fixed`` (choices the search keeps), ``HostLink``,
``Candidate`` and ``Plan`` (with ``summary``/``to_dict``); and the search's own terms, the ``Problem`` (the fixed inputs
of one planning problem) and a ``Configuration`` (a candidate but for its block assignment).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from memtrain import techniques
from memtrain.choices import Choices
from memtrain.errors import ConfigError
from memtrain.planner.devices import DeviceProfile
from memtrain.precision import PRECISIONS
from memtrain.report import MemoryReport, format_bytes
from memtrain.techniques.optimizer import NamedOptimizer

# The kinds a block can be, in plans: what it keeps for backward, and what it costs.
BlockKind = Literal["keep", "recompute", "offload"]
RecomputeFlavor = Literal["full", "selective", "offload-inputs"]
OptimizerPlacement = Literal["device", "offload", "offload-bf16-weights"]
Distribution = Literal["none", "ddp", "fsdp2"]

DEFAULT_SAFETY_MARGIN = 0.05  # of the budget, left for the allocator's fragmentation


# -- the plan -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Configuration:
    """A candidate but for its block assignment (offloaded, recomputed and kept counts): every choice of one set-up
    of the search, ``PlanSettings`` less the blocks. The techniques' settings default to the plain ones (what
    ``Fixed.settings`` leaves a choice it has not)."""

    micro_batch_size: int
    accumulation: int  # micro-batches per optimizer step on each rank
    flavor: RecomputeFlavor  # how the recomputed blocks recompute
    chunked_loss: bool = False
    optimizer: OptimizerPlacement = "device"
    distribution: Distribution
    compile: bool = False
    precision: str = "bf16-mixed"  # compute precision (autocast): fp32, bf16-mixed, fp16-mixed
    state_precision: str = "fp32"  # AdamW's moments: fp32 (8 bytes/param), bf16 (4), int8 (about 2)
    step_in_backward: bool = False  # each parameter steps as its gradient is final, which is freed at once
    offload_fraction: float = 0.0  # with optimizer "device": this share of the parameters' state in host RAM
    pure_bf16: bool = False  # bf16 weights, no fp32 master, updates rounded stochastically (only when asked for)
    # Parameter offload: the blocks' weights in host RAM (the offloaded optimizer's), streamed one block ahead
    offload_weights: bool = False
    tiled_mlp: bool = False  # each block's MLP over tiles of tokens (memtrain.tiled_mlp)
    # The optimizer's class: memtrain's AdamW, or one the run names (never the plan's choice). Out of the repr (the
    # search's tables are compared by it): memtrain's AdamW for every configuration of a plan but a named class's.
    optimizer_class: NamedOptimizer = dataclasses.field(default=NamedOptimizer(), repr=False)

    def assigned(self, n_blocks: int, offload: int, recompute: int) -> PlanSettings:
        """This set-up over ``n_blocks`` blocks, the first ``offload`` offloaded, the next ``recompute``
        recomputed, the rest kept (``_assignment``)."""
        return self.with_blocks(_assignment(n_blocks, offload, recompute))

    def with_blocks(self, blocks: tuple[BlockKind, ...]) -> PlanSettings:
        """This set-up with each block's kind (in the model's order): a plan's settings."""
        return PlanSettings(blocks=blocks, **{f.name: getattr(self, f.name) for f in dataclasses.fields(Configuration)})

    @property
    def host_fraction(self) -> float:
        """The share of the parameters whose optimizer state (and gradients) go to the host."""
        return techniques.optimizer.TECHNIQUE.host_fraction(self)


@dataclass(frozen=True, kw_only=True)
class PlanSettings(Configuration):
    """Every choice of one candidate: what ``apply_plan`` sets up (its ``Configuration`` and each block's kind)."""

    blocks: tuple[BlockKind, ...]  # per block, in the model's order
    # In a plan's repr, unlike a Configuration's (the search's tables are compared by theirs): two plans that differ
    # in their class read differently.
    optimizer_class: NamedOptimizer = NamedOptimizer()

    def __post_init__(self) -> None:
        # Where no block recomputes, every flavor is one set-up (the search keeps its first flavor's rows): written
        # "full", so that one set-up has one record (``choices`` names no flavor there).
        flavors = ("selective", "offload-inputs")
        if isinstance(self.blocks, tuple) and "recompute" not in self.blocks and self.flavor in flavors:
            object.__setattr__(self, "flavor", "full")

    @property
    def optimizer_text(self) -> str:
        """The optimizer in words, e.g. "device, int8 moments, step in backward" (the optimizer's, with the
        techniques that change what it keeps: pure bf16, streamed weights)."""
        return techniques.optimizer.TECHNIQUE.planned_text(self)

    @property
    def loss_text(self) -> str:
        """The loss in one word: "chunked" (1024 tokens of logits at a time) or "whole"."""
        return techniques.chunked_loss.TECHNIQUE.planned_text(self)

    @property
    def mlp_text(self) -> str:
        """", tiled MLP" where the blocks' MLPs are tiled, else "" (to follow the loss in a set-up's words)."""
        text = techniques.tiled_mlp.TECHNIQUE.planned_text(self)
        return f", {text}" if text else ""

    @property
    def checkpointing(self) -> str:
        """A short name: none, all, selective, all+offload-inputs, or counts per kind."""
        return techniques.checkpointing.TECHNIQUE.planned_text(self)

    @property
    def choices(self) -> Choices:
        """This set-up in the user's setting type: the ``Choices`` that fix every technique as it is here (each
        technique's part, ``Technique.chosen``). A run given them, with this run shape, gets this set-up again
        (``PlanSettings.of_choices``): ``TrainConfig(choices=plan.settings.choices)``, ``plan(choices=...)``."""
        return Choices(**techniques.chosen(self))

    @classmethod
    def of_choices(cls, choices: Choices, *, micro_batch_size: int, accumulation: int, distribution: Distribution,
                   precision: str, n_blocks: int, device: str = "cuda") -> PlanSettings:
        """The one set-up ``choices`` fix (every technique fixed, as ``choices`` returns them) for this run shape,
        over ``n_blocks`` blocks on ``device``: the inverse of ``choices``, through ``Fixed.of_choices``, the one
        translation of a run's choices into a plan's terms (what they leave open, plain: ``Fixed.settings``)."""
        fixed, _, _ = Fixed.of_choices(choices, n_blocks=n_blocks, device=device)
        return fixed.settings(micro_batch_size=micro_batch_size, accumulation=accumulation, distribution=distribution,
                              precision=precision)

    def policies(self, names: Sequence[str]) -> dict[str, BlockKind]:
        """``apply_checkpointing(policies=)`` for the block names (in order)."""
        return dict(zip(names, self.blocks, strict=True))

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint, a run's config.json and ``plan --json`` store of this set-up: the run's shape
        (``RUN_SHAPE``), the block count and the ``Choices`` that fix every technique (``choices.to_dict()``), the
        user's own setting type; ``from_dict`` reads it back through ``of_choices``.

        Raises:
            ValueError: settings the choices do not give back (a set-up no rule allows, made by hand): written, they
                would read back as another.
        """
        choices = self.choices
        # The set-up was resolved for its device: on "cuda" every choice is kept as it is.
        back = self.of_choices(choices, **{name: getattr(self, name) for name in RUN_SHAPE},
                               n_blocks=len(self.blocks), device="cuda")
        if back != self:
            raise ValueError(f"{self!r} is not the set-up its choices fix ({choices!r}): it has no saved form")
        return {**{name: getattr(self, name) for name in RUN_SHAPE}, "n_blocks": len(self.blocks),
                "choices": choices.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanSettings:
        """The settings ``to_dict`` wrote (e.g. in a run's checkpoint), or the form of each field its own key that a
        memtrain before the choices wrote (``_from_fields``).

        Raises:
            ConfigError: a dictionary that is not one (not a mapping, a missing field, a value of the wrong kind,
                choices that leave a technique to a plan, a block count the layout does not have), or a set-up a run
                cannot take.
        """
        if isinstance(d, Mapping) and "choices" not in d and "blocks" in d:
            return cls._runnable(cls._from_fields(d))
        missing = sorted({*RUN_SHAPE, "n_blocks", "choices"} - set(d)) if isinstance(d, Mapping) else None
        if missing is None or missing:
            why = "not a mapping" if missing is None else f"missing {', '.join(missing)}"
            raise ConfigError(f"{d!r} is not a plan's settings ({why}). {_PASS_SAVED}")
        n_blocks, saved = d["n_blocks"], d["choices"]
        if not isinstance(n_blocks, int) or isinstance(n_blocks, bool) or n_blocks < 0:
            raise ConfigError(f"a plan's settings with n_blocks={n_blocks!r} (not a count of blocks). {_PASS_SAVED}")
        if not isinstance(saved, Mapping):
            raise ConfigError(f"a plan's settings with choices={saved!r} (not a mapping). {_PASS_SAVED}")
        try:
            given = Choices.from_dict(saved)
        except ConfigError as e:  # in the saved form's terms: the user passed no flag
            raise ConfigError([f"a plan's saved choices: {problem}" for problem in e.problems]) from None
        if given.checkpointing is None:
            raise ConfigError(f"a plan's settings whose choices leave checkpointing to a plan (None): a saved plan "
                              f"fixes each block. {_PASS_SAVED}")
        settings = cls._checked(cls.of_choices(given, **{name: d[name] for name in RUN_SHAPE}, n_blocks=n_blocks,
                                               device="cuda"))
        if len(settings.blocks) != n_blocks:
            raise ConfigError(f"a plan's settings with n_blocks={n_blocks} and choices.checkpointing="
                              f"{str(given.checkpointing)!r}, a layout of {len(settings.blocks)} blocks. "
                              f"{_PASS_SAVED}")
        left = _left_open(given.to_dict(), settings.choices.to_dict())
        if left:  # read as its plain default, a choice left to a plan would change the set-up
            raise ConfigError(f"a plan's settings whose choices leave {', '.join(left)} to a plan (None): a saved "
                              f"plan fixes each. {_PASS_SAVED}")
        return cls._runnable(settings)

    @classmethod
    def _from_fields(cls, d: Mapping[str, Any]) -> PlanSettings:
        """Each field as its own key (what ``to_dict`` wrote before the choices: a checkpoint of an earlier run)."""
        names = {f.name for f in dataclasses.fields(cls)}
        # memtrain's AdamW is every plan's but a named class's: that form wrote the class only otherwise; the tiled
        # MLP came after that form (its runs' MLPs were whole: the field's default)
        missing = sorted(names - {"optimizer_class", "tiled_mlp"} - set(d))
        if missing:
            raise ConfigError(f"{dict(d)!r} is not a plan's settings (missing {', '.join(missing)}). {_PASS_SAVED}")
        convert = {"blocks": lambda v: tuple(v) if isinstance(v, (list, tuple)) else v,
                   "optimizer_class": NamedOptimizer.from_dict}
        try:
            settings = cls(**{k: convert.get(k, lambda v: v)(v) for k, v in d.items() if k in names})
        except (TypeError, AttributeError, KeyError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{dict(d)!r} is not a plan's settings ({type(e).__name__}: {e}). {_PASS_SAVED}") \
                from None
        return cls._checked(settings)

    @classmethod
    def _checked(cls, settings: PlanSettings) -> PlanSettings:
        """``settings`` whose every field is of its kind, and the run's shape counts of at least one."""
        wrong = kind_problems(settings)
        wrong += [f"{name}={getattr(settings, name)!r} (not >= 1)" for name in ("micro_batch_size", "accumulation")
                  if not any(name in w for w in wrong) and getattr(settings, name) < 1]
        if settings.precision not in PRECISIONS:
            wrong.append(f"precision={settings.precision!r} (not one of {', '.join(map(repr, PRECISIONS))})")
        if wrong:
            raise ConfigError(f"a plan's settings with {'; '.join(wrong)}. {_PASS_SAVED}")
        return settings

    @classmethod
    def _runnable(cls, settings: PlanSettings) -> PlanSettings:
        """``settings`` that a run can take (the techniques' rules, with its precision and processes) and that
        ``to_dict`` writes back as themselves."""
        try:
            choices = settings.choices
            choices.check_run(world_size=1 if settings.distribution == "none" else 2,
                              fsdp=settings.distribution == "fsdp2")
            ConfigError.raise_if(choices.precision_problems(settings.precision, auto=False))
            settings.to_dict()
        except (ConfigError, ValueError) as e:
            problems = e.problems if isinstance(e, ConfigError) else (str(e),)
            raise ConfigError([f"a plan's saved settings that no run can take: {p}" for p in problems]) from None
        return settings


_PASS_SAVED = "To resolve this error, pass what PlanSettings.to_dict() wrote."


def _left_open(given: Mapping[str, Any], chosen: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The names (``optimizer.placement``) of the choices ``given`` leaves None where ``chosen`` fixes them."""
    names = []
    for name, value in chosen.items():
        if isinstance(value, Mapping):
            names += _left_open(given.get(name) or {}, value, f"{prefix}{name}.")
        elif value is not None and given.get(name) is None:
            names.append(prefix + name)
    return names


def kind_problems(record: Any) -> list[str]:
    """Each field of the dataclass ``record`` whose value is not of the kind its annotation declares (a ``Literal``'s
    values, a bool, an int, a number, a string, a tuple of a kind, a class), e.g. "micro_batch_size='4' (an int)"."""
    hints = typing.get_type_hints(type(record))
    return [f"{f.name}={getattr(record, f.name)!r} (not {_kind_text(hints[f.name])})"
            for f in dataclasses.fields(record) if not _is_kind(getattr(record, f.name), hints[f.name])]


def _is_kind(value: Any, kind: Any) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin is tuple:
        return isinstance(value, tuple) and all(_is_kind(v, args[0]) for v in value)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _kind_text(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is tuple:
        return f"a list of {_kind_text(args[0])}"
    return {bool: "True or False", int: "an integer", float: "a number", str: "a string"}.get(kind, kind.__name__)


# The run's shape: what a plan sets beside its techniques' settings, never a choice a run fixes for the search.
RUN_SHAPE = ("micro_batch_size", "accumulation", "distribution", "precision")


class _FixedChoices:
    """``Fixed``'s methods (its fields are ``PlanSettings``'s, below)."""

    @classmethod
    def of_choices(cls, choices: Choices, *, n_blocks: int, device: str) -> tuple[Any, frozenset[str], list[str]]:
        """A run's ``Choices`` (a ``TrainConfig``'s, a command's flags; None: the plan's) as the constraints of a plan:
        each technique's share (``memtrain.techniques.fixed_shares``), the one translation of choices into what the
        search keeps.

        Returns:
            (the fixed choices, the ``TECHNIQUES`` the search may use, notes for choices that do nothing on
            ``device``).

        Raises:
            ConfigError: ``choices`` not a ``Choices``; a selective policy the planner cannot plan.
        """
        if not isinstance(choices, Choices):
            raise ConfigError(f"choices={choices!r} is not a Choices. To resolve this error, pass Choices(...) or "
                              "Choices.from_dict(...).")
        share = techniques.fixed_shares(choices, device=device, n_blocks=n_blocks)
        return cls(**share.values), frozenset(TECHNIQUES) - share.closed, list(share.notes)

    def left_open(self) -> list[str]:
        """The arguments that would fix what these choices leave to the search (for a run that cannot plan)."""
        return techniques.left_open(self)

    def settings(self, *, micro_batch_size: int, accumulation: int, distribution: Distribution, precision: str,
                 blocks: tuple[BlockKind, ...] | None = None, flavor: RecomputeFlavor | None = None) -> PlanSettings:
        """These choices as one set-up where no search runs, what they leave open plain (``PlanSettings``'s
        defaults): the loss whole, the optimizer fused fp32 AdamW on the device (or the run's class), nothing
        offloaded, eager; the blocks and their flavor these choices' unless given."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        given.update(blocks=self.blocks if blocks is None else blocks, flavor=self.flavor if flavor is None else flavor)
        return PlanSettings(micro_batch_size=micro_batch_size, accumulation=accumulation, distribution=distribution,
                            precision=precision, **given)


# Choices a plan keeps as given, in the search's terms (``of_choices`` makes them from a run's ``Choices``): each of
# ``PlanSettings``'s fields but the run's shape, declared there once; None leaves that choice to the search. The
# optimizer's class is the run's (never the search's to choose); ``pure_bf16=True`` keeps only pure bf16 set-ups,
# None none (the plan computes them for a hint only: pure bf16 changes the numerics, so the plan never picks it).
Fixed = dataclasses.make_dataclass(
    "Fixed",
    [(f.name, f"{f.type} | None", dataclasses.field(default=None)) if f.name != "optimizer_class"
     else (f.name, f.type, dataclasses.field(default=NamedOptimizer()))
     for f in dataclasses.fields(PlanSettings) if f.name not in RUN_SHAPE],
    bases=(_FixedChoices,), frozen=True, kw_only=True)
Fixed.__module__, Fixed.__doc__ = __name__, ("Choices a plan keeps as given, in the search's terms (``of_choices`` makes them from a run's "
                 "``Choices``): ``PlanSettings``'s fields but the run's shape (``RUN_SHAPE``); None leaves that choice "
                 "to the search.")


@dataclass(frozen=True)
class HostLink:
    """Bytes over the host link (PCIe, or NVLink-C2C) in one optimizer step, per rank, as the time model counts
    them: offloaded activations go out in each micro-batch's forward and come back in its backward; an offloaded
    optimizer's gradients (the device weights' dtype) go out in each micro-batch's backward and its new weights
    come back once a step. Small transfers (norms, flags, the loss) are not counted."""

    activations_to_host: int
    activations_to_device: int
    optimizer_to_host: int
    optimizer_to_device: int
    weights_to_device: int = 0  # parameter offload: every block's weights in each micro-batch's forward and backward

    @property
    def to_host(self) -> int:
        return self.activations_to_host + self.optimizer_to_host

    @property
    def to_device(self) -> int:
        return self.activations_to_device + self.optimizer_to_device + self.weights_to_device

    @property
    def total(self) -> int:
        return self.to_host + self.to_device

    def text(self) -> str:
        """E.g. "1.0 GiB to host, 512.0 MiB to device (activations 512.0 MiB each way; optimizer ...)"."""
        parts = []
        if self.activations_to_host or self.activations_to_device:
            parts.append(f"activations {format_bytes(self.activations_to_host)} out, "
                         f"{format_bytes(self.activations_to_device)} back")
        if self.optimizer_to_host or self.optimizer_to_device:
            parts.append(f"optimizer {format_bytes(self.optimizer_to_host)} gradients out, "
                         f"{format_bytes(self.optimizer_to_device)} weights back")
        if self.weights_to_device:
            parts.append(f"block weights {format_bytes(self.weights_to_device)} streamed in")
        return (f"{format_bytes(self.to_host)} to host, {format_bytes(self.to_device)} to device"
                + (f" ({'; '.join(parts)})" if parts else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"activations_to_host": self.activations_to_host, "activations_to_device": self.activations_to_device,
                "optimizer_to_host": self.optimizer_to_host, "optimizer_to_device": self.optimizer_to_device,
                "weights_to_device": self.weights_to_device, "to_host": self.to_host, "to_device": self.to_device, "total": self.total}


@dataclass(frozen=True)
class Candidate:
    """One candidate's predictions and, unless it was chosen, why it lost."""

    settings: PlanSettings
    peak_bytes: int  # per rank, on the device
    host_bytes: int  # per node (every rank's share)
    step_seconds: float
    tokens_per_s: float
    verified: bool  # the peak is a full estimate of this set-up (else composed: ``FullEstimates.peak``)
    lost_because: str = ""
    host_link: HostLink | None = None  # bytes over the host link per step, per rank

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings.to_dict(), "peak_bytes": self.peak_bytes, "host_bytes": self.host_bytes,
                "step_seconds": self.step_seconds, "tokens_per_s": self.tokens_per_s, "verified": self.verified,
                "lost_because": self.lost_because,
                "host_link": self.host_link.to_dict() if self.host_link is not None else None}


@dataclass(frozen=True)
class Plan:
    """The chosen set-up with its predictions, one reason per decision, and the runners-up.

    ``peak_bytes`` is a full ``estimate`` of exactly this set-up (per rank); ``activation_bytes`` the bytes saved
    for backward in one micro-batch (on the CPU exactly what ``measure`` counts).
    """

    settings: PlanSettings
    budget_bytes: int | None  # None: unlimited
    usable_bytes: int | None  # the budget less the safety margin
    host_budget_bytes: int | None
    peak_bytes: int
    host_bytes: int
    activation_bytes: int
    step_seconds: float
    tokens_per_s: float
    precision: str
    device: str  # "cuda" or "cpu"
    seq_len: int
    global_batch_size: int
    world_size: int
    block_names: tuple[str, ...]
    parameters: int
    reasons: tuple[str, ...]
    candidates: tuple[Candidate, ...]  # the runners-up, fastest first
    assumptions: tuple[str, ...]
    device_profile: DeviceProfile
    report: MemoryReport  # the estimate behind peak_bytes
    plan_seconds: float = 0.0  # how long planning took
    host_link: HostLink = HostLink(0, 0, 0, 0)  # bytes over the host link per step, per rank

    @property
    def host_link_bytes(self) -> int:
        """Bytes over the host link in one optimizer step, per rank, both directions (see ``host_link``)."""
        return self.host_link.total

    @property
    def micro_batch_size(self) -> int:
        return self.settings.micro_batch_size

    @property
    def accumulation(self) -> int:
        return self.settings.accumulation

    @property
    def _reserved_text(self) -> str:
        """" (reserved X, runs in Y)": the allocator's predicted peak reserved per rank on a device with room to
        spare, and the least memory it runs in (segments given back where an allocation fails: what the budget
        holds), where the estimate has them (shifted as the peak is from the traced step: the ranks' shards, the
        streamed weights)."""
        reserved, needed = self.report.reserved_bytes, self.report.needed_bytes
        if reserved is None or needed is None:
            return ""
        shift = self.peak_bytes - (self.report.peak_bytes or 0)
        return f" (reserved {format_bytes(reserved + shift)}, runs in {format_bytes(needed + shift)})"

    def summary(self) -> str:
        """The choice, its predictions and reasons, and the runners-up, as a table (returned, not printed)."""
        s = self.settings
        budget = "unlimited" if self.budget_bytes is None else (
            f"{format_bytes(self.budget_bytes)} (usable {format_bytes(self.usable_bytes)})")
        lines = [
            f"plan for {self.parameters / 1e6:.1f}M parameters, {self.global_batch_size} x {self.seq_len} tokens per "
            f"step, {self.precision}, on {self.device_profile.name} x {self.world_size}; budget {budget}",
            f"  choice: micro-batch {s.micro_batch_size} x {s.accumulation} accumulation, checkpointing "
            f"{s.checkpointing}, loss {s.loss_text}{s.mlp_text}, optimizer {s.optimizer_text}, "
            f"{s.distribution if self.world_size > 1 else 'one process'}{', compiled' if s.compile else ''}",
            f"  predicted: peak {format_bytes(self.peak_bytes)} per rank{self._reserved_text}, host "
            f"{format_bytes(self.host_bytes)}, "
            f"step {self.step_seconds * 1e3:.1f} ms, {self.tokens_per_s:,.0f} tokens/s",
            *([f"  host link per step: {self.host_link.text()}"] if self.host_link.total else []),
            "  because:",
            *(f"    - {r}" for r in self.reasons),
        ]
        if self.candidates:
            rows = [("micro x acc", "checkpointing", "loss", "optimizer", "dist", "peak", "tokens/s", "lost because")]
            for c in self.candidates:
                cs = c.settings
                rows.append((f"{cs.micro_batch_size} x {cs.accumulation}", cs.checkpointing,
                             cs.loss_text + cs.mlp_text,
                             cs.optimizer_text + (" +compile" if cs.compile else ""), cs.distribution,
                             format_bytes(c.peak_bytes) + ("" if c.verified else "*"), f"{c.tokens_per_s:,.0f}",
                             c.lost_because))
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines.append("  runners-up (* composed from the block profiles, not a full estimate):")
            lines += ["    " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``plan`` (the settings: ``PlanSettings.to_dict``), the predictions, ``candidates``, reasons and assumptions."""
        return {
            "plan": self.settings.to_dict(),  # the run's shape and the Choices that fix the set-up
            "peak_bytes": self.peak_bytes,
            "host_bytes": self.host_bytes,
            "activation_bytes": self.activation_bytes,
            "step_seconds": self.step_seconds,
            "tokens_per_s": self.tokens_per_s,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "precision": self.precision,
            "device": self.device,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "parameters": self.parameters,
            "blocks": list(self.block_names),
            "reasons": list(self.reasons),
            "candidates": [c.to_dict() for c in self.candidates],
            "assumptions": list(self.assumptions),
            "device_profile": self.device_profile.to_dict(),
            "plan_seconds": self.plan_seconds,
            "host_link": self.host_link.to_dict(),
            "estimate": self.report.to_dict(),
        }


# -- the planning problem, and a candidate but for its blocks -----------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Problem:
    """The fixed inputs of one planning problem."""

    model: Any
    seq_len: int
    global_batch: int
    world: int
    device: str
    precision: str
    device_profile: DeviceProfile
    block_names: tuple[str, ...]
    chunkable: bool
    grad_clip: bool
    packed: bool = False  # batches of packed rows: the trace passes their labels and position_ids, as the loop does
    precision_reason: str | None = None  # why ``precision`` ("fp32, because: ..."); None: it was requested
    kept_share: float = 1.0  # the share of label positions the loss counts: the chunked loss's head runs on those


def _assignment(n_blocks: int, offload: int, recompute: int) -> tuple[BlockKind, ...]:
    """Offloaded blocks first (they come back last in backward: the most time to prefetch), then the recomputed
    ones, then the kept ones (the last blocks' activations are the first backward frees)."""
    return (("offload",) * offload + ("recompute",) * recompute
            + ("keep",) * (n_blocks - offload - recompute))  # type: ignore[return-value]


TECHNIQUES = techniques.SEARCH  # the names plan(techniques=) takes: every technique's, in the registry's order


def configuration_of(s: PlanSettings) -> Configuration:
    """A plan's set-up less its blocks: the key the composer's caches share across layouts (a PlanSettings
    compares and hashes with its blocks)."""
    return Configuration(**{f.name: getattr(s, f.name) for f in dataclasses.fields(Configuration)})
