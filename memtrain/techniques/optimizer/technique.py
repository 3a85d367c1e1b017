"""The optimizer as a technique (``TECHNIQUE``): its rules with the other techniques, each written once (where its
state may live with FSDP2, DDP, a partial offload and a step in backward, and what a named class cannot take), its
share of a plan's fixed choices, its values in the search, its reason line, its part of an estimate's set-up, and what
the Trainer helper cannot do of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from memtrain.errors import ConfigError
from memtrain.message import WHATEVER, Message, arg, marked
from memtrain.techniques.distribution import shards_on_host
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.optimizer.named import NamedOptimizer
from memtrain.techniques.rule import Rule, SetUp
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace

StatePrecision = Literal["fp32", "bf16", "int8"]
STATE_PRECISIONS: tuple[StatePrecision, ...] = ("fp32", "bf16", "int8")
PARTIAL_FRACTIONS = (0.25, 0.5, 0.75)  # the shares of a device optimizer's state the search tries in host RAM
OFFLOADED = ("offload", "offload-bf16-weights")  # the placements that keep all of the state in host RAM


def offloads_optimizer(placement: str | None, offload_weights: bool | None) -> bool:
    """Whether the optimizer's state lives in host RAM: placed there, or left open with parameter offload, which
    streams the weights from the offloaded optimizer's master and so implies it."""
    return placement in OFFLOADED or (placement is None and bool(offload_weights))


# Classes whose step needs every gradient at once (or a closure), so a parameter cannot step alone in backward.
NOT_PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.LBFGS,)


def _per_parameter(named: NamedOptimizer | None) -> bool:
    if named is None or named.is_adamw:
        return True
    try:
        cls = named.resolve()
    except ConfigError:
        return True  # a class that does not resolve is refused for that, where it is named
    return not issubclass(cls, NOT_PER_PARAMETER)


# -- the rules ---------------------------------------------------------------------------------------------------
GRADIENTS_BEFORE_DDP = Rule(
    "gradients-before-ddp",
    "DDP and FSDP2 reduce gradients over the ranks after the hooks that act on them (a step in backward, a partial "
    "offload, gradients offloaded as produced), so each rank would step on its own gradient and the ranks' weights "
    "would drift apart.",
    "drop {but_last}, or run one process",
    ("step_in_backward", "offload_fraction", "processes"),
    lambda s: s.several_processes and bool(s.step_in_backward or s.offload_fraction))
OFFLOAD_OPTIMIZER_FSDP = Rule(
    "offload-optimizer-fsdp",
    "FSDP2 offloads its shards as they are stored (CPUOffloadPolicy: the fp32 master in host RAM, copied to the "
    "device as each block is gathered), and bf16 device weights beside a host master are CPUOffloadOptimizer's, "
    "which needs whole parameters.",
    f"pass {arg('optimizer.placement', 'offload')} (FSDP2's host offload), or drop {{rest}} (DDP)",
    ("placement", "fsdp"),
    lambda s: s.placement == "offload-bf16-weights" and bool(s.fsdp))
OFFLOAD_OPTIMIZER_FSDP_MOMENTS = Rule(
    "offload-optimizer-fsdp-moments",
    "FSDP2's host step is torch's fused AdamW over each rank's shard (fp32 moments); memtrain's lean moments step "
    "whole tensors.",
    f"pass {arg('optimizer.state_precision', 'fp32')}, or drop one of {{rest}}",
    ("state_precision", "placement", "fsdp"),
    lambda s: s.placement == "offload" and bool(s.fsdp) and s.adamw and s.state_precision not in (None, "fp32"))
OFFLOAD_WITH_FRACTION = Rule(
    "offload-with-fraction",
    "the first puts all of the optimizer state in host RAM, the second a share of a device optimizer's.",
    "pass one of them",
    ("placement", "offload_fraction"),
    lambda s: s.placement in OFFLOADED and s.offload_fraction is not None, shows_false=("offload_fraction",))
OFFLOAD_WITH_IN_BACKWARD = Rule(
    "offload-with-step-in-backward",
    "the offloaded optimizer already takes each gradient off the device as it is produced and steps on the host; "
    f"{arg('step_in_backward')} is for the device optimizer.",
    "pass one of them",
    ("placement", "step_in_backward"),
    lambda s: s.placement in OFFLOADED and bool(s.step_in_backward))
IN_BACKWARD_WITH_FRACTION = Rule(
    "step-in-backward-with-fraction",
    "a partial offload steps after backward.",
    "pass one of them",
    ("step_in_backward", "offload_fraction"),
    lambda s: bool(s.step_in_backward) and bool(s.offload_fraction),
    # NOTE: build_optimizer builds it (the device part steps in backward, the host part after it); the plan's cost
    # model does not, so the choices and the plan refuse it.
    planned_only=True)
IN_BACKWARD_FP16_SCALER = Rule(
    "step-in-backward-fp16-scaler",
    "an overflow must stop the parameters still to step on a flag read on the device, which only fused AdamW (fp32 "
    "moments) takes, not lean moments or another optimizer class.",
    f"pass bf16-mixed precision (no scaler) or {arg('step_in_backward', False)}, or AdamW with "
    f"{arg('state_precision', 'fp32')}",
    ("step_in_backward", "precision", "optimizer", "state_precision"),
    lambda s: bool(s.step_in_backward) and s.precision == "fp16-mixed" and (
        s.state_precision not in (None, "fp32") or not s.adamw))
IN_BACKWARD_PER_PARAMETER = Rule(
    "step-in-backward-per-parameter",
    "its step needs every parameter's gradient (or a closure re-evaluating the loss), so a parameter cannot step "
    "alone as its gradient is final.",
    f"use AdamW (build_optimizer's default) or pass {arg('step_in_backward', False)}",
    ("step_in_backward", "optimizer"),
    lambda s: bool(s.step_in_backward) and not _per_parameter(s.optimizer))
BF16_WEIGHTS_PRECISION = Rule(
    "bf16-device-weights-precision",
    "its device weights are bf16 casts of the host master, which only bf16-mixed computes in.",
    f"pass {arg('precision', 'bf16-mixed')}, or {arg('optimizer.placement', 'offload')} (fp32 device weights)",
    ("placement", "precision"),
    lambda s: s.placement == "offload-bf16-weights" and s.precision not in (None, "auto", "bf16-mixed"))
NAMED_OWN_STATE = Rule(
    "named-optimizer-own-state",
    "lean moments and pure bf16 are memtrain's AdamW's; another optimizer class keeps its own state.",
    "drop {first} (memtrain's AdamW is the optimizer with lean moments and pure bf16), or drop {rest}",
    ("optimizer", "state_precision", "pure_bf16"),
    lambda s: not s.adamw and (s.state_precision not in (None, "fp32") or bool(s.pure_bf16)))


# -- its reason line ---------------------------------------------------------------------------------------------
# The placements in the reasons; an alternative is named by the text before its parenthesis.
PLACEMENT_TEXT = {"device": "AdamW on the device",
                  "offload": "AdamW on the CPU (CPUOffloadOptimizer: fp32 master and state in host RAM)",
                  "offload-bf16-weights": "AdamW on the CPU with bf16 weights on the device (fp32 master in host RAM)"}
SHARDED_ON_HOST_TEXT = ("AdamW on the CPU (FSDP2's CPUOffloadPolicy: each rank's shard of the fp32 master, of the "
                        "gradients and of the state in host RAM)")


def _named(name: str, pure_bf16: bool, named: NamedOptimizer | None = None) -> str:
    """The optimizer's name in the reasons: AdamW's, or the class the run names; pure bf16 (only when asked for)
    has no master anywhere."""
    if named is not None and not named.is_adamw:
        return name.replace("AdamW", named.path.rpartition(".")[2])
    if not pure_bf16:
        return name
    return name.replace("fp32 master and state", "state").replace(
        "AdamW", "pure bf16 AdamW (bf16 weights, no fp32 master, stochastic rounding; as asked)")


def _chosen_text(view: PlanView, s: Any) -> str:
    """The chosen optimizer in words: its placement, then its moments, its step in backward and its offloaded
    share where they are not the plain ones."""
    text = _named(SHARDED_ON_HOST_TEXT if shards_on_host(s) else PLACEMENT_TEXT[s.optimizer], s.pure_bf16,
                  s.optimizer_class)
    details = []
    if s.state_precision != "fp32":
        details.append(f"{s.state_precision} moments ({ {'bf16': 4, 'int8': 2}[s.state_precision]} bytes/param, "
                       "not 8)")
    if s.step_in_backward:
        details.append("each parameter stepping in backward, its gradient freed at once"
                       + (" (one backward pass: clipped by the previous step's norm, the first step unclipped)"
                          if view.grad_clip else ""))
    if s.offload_fraction:
        details.append(f"{100 * s.offload_fraction:.0f}% of the state in host RAM")
    if details:
        return f"{text} with {', '.join(details)}"
    if not s.optimizer_class.is_adamw:
        return f"{text} ({s.optimizer_class.text}, as asked: its own state)"
    if s.optimizer == "device" and not s.pure_bf16:
        return f"{text} (fused, fp32 moments)"
    return text


class OptimizerTechnique(Technique):
    """The optimizer's class (named, never planned), placement, moments and step."""

    name = "optimizer"
    fields = ("optimizer",)  # the Choices field this technique owns: an OptimizerChoice, of SETTING_FIELDS
    rules = (GRADIENTS_BEFORE_DDP, OFFLOAD_OPTIMIZER_FSDP, OFFLOAD_OPTIMIZER_FSDP_MOMENTS, OFFLOAD_WITH_FRACTION, OFFLOAD_WITH_IN_BACKWARD,
             IN_BACKWARD_WITH_FRACTION, IN_BACKWARD_FP16_SCALER, IN_BACKWARD_PER_PARAMETER, BF16_WEIGHTS_PRECISION,
             NAMED_OWN_STATE)
    search = ("offload-optimizer", "bf16-weights", "optimizer-state", "step-in-backward")

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """The optimizer's share of a plan's fixed choices (``choices``: a ``Choices``). Placed on the device (or
        given lean moments, an in-backward step or an offloaded share) it is never offloaded; placed on the device, it
        keeps fp32 weights and no share of its state on the host. Another class keeps its own state: no lean moments
        to search."""
        opt = choices.optimizer  # an OptimizerChoice
        closed, fraction = set(), opt.offload_fraction
        if opt.placement == "device":
            closed |= {"offload-optimizer", "bf16-weights"}
            fraction = 0.0 if fraction is None else fraction
        named, state_precision = opt.named, opt.state_precision
        if not named.is_adamw:
            closed.add("optimizer-state")
            state_precision = "fp32"
        return Fixing({"optimizer": opt.fixed_placement, "state_precision": state_precision,
                       "step_in_backward": opt.step_in_backward, "offload_fraction": fraction,
                       "optimizer_class": named}, closed)

    def left_open(self, fixed: Any) -> list[str]:
        """What fixes the optimizer where the plan cannot choose it (``fixed``: a plan's ``Fixed``): its placement, and
        on the device (or where the plan could put it there) its moments and its step."""
        on_device = fixed.optimizer not in OFFLOADED
        return [Message(arg(name, value)) for name, value, fixed_value in (
            ("optimizer.placement", "device", fixed.optimizer),
            ("optimizer.state_precision", "fp32", fixed.state_precision if on_device else "fp32"),
            ("optimizer.step_in_backward", False, fixed.step_in_backward if on_device else False))
            if fixed_value is None]

    def reasons(self, view: PlanView) -> list[str]:
        """The optimizer (placement, moments, when it steps), against fused fp32 AdamW on the device, the other
        placements, and a leaner device optimizer."""
        s = view.settings
        placement, state = view.column("optimizer"), view.column("state_precision")
        in_backward, fraction = view.column("step_in_backward"), view.column("offload_fraction")
        plain = (placement == "device") & (state == "fp32") & (in_backward == False) & (fraction == 0)  # noqa: E712
        chosen_plain = bool(plain[view.chosen])
        alternatives = []
        if not chosen_plain:
            fused = "fused fp32 AdamW on the device"
            alternatives.append(view.alternative(plain, fused if s.optimizer_class.is_adamw else _named(
                fused, False, s.optimizer_class).replace("fused fp32 ", "")))
        alternatives += [view.alternative(placement == o, _named(PLACEMENT_TEXT[o].split(" (")[0], False,
                                                                 s.optimizer_class)) for o in PLACEMENT_TEXT
                         if o != s.optimizer and o != "device" and (placement == o).any()]
        if chosen_plain and (~plain & (placement == "device")).any():
            alternatives.append(view.alternative(~plain & (placement == "device"), "a leaner device optimizer",
                                                 lean=True))
        alternatives = [a for a in alternatives if a]
        if s.offload_weights and not alternatives:  # the only placement that streamed weights leave
            alternatives = ["parameter offload streams the blocks' weights from its master in host RAM"]
        text = f"optimizer {_chosen_text(view, s)}"
        if alternatives:
            return [f"{text}, because: {'; '.join(alternatives)}"]
        return [text + ("" if view.device == "cuda" else ": on a CPU an offload only copies within RAM")]

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """On the device; on CUDA offloaded too (with bf16 device weights where bf16-mixed computes in them);
        fp32 moments, and bf16 and int8 (where bitsandbytes runs) ones where lean moments are allowed."""
        space.placements = ["device"]
        if problem.cuda and "offload-optimizer" in allowed:
            space.placements.append("offload")
            if "bf16-weights" in allowed and not BF16_WEIGHTS_PRECISION.refuses(
                    SetUp(placement="offload-bf16-weights", precision=problem.precision)):
                space.placements.append("offload-bf16-weights")
        space.states = ["fp32"]
        if "optimizer-state" in allowed:
            space.states += ["bf16", *(["int8"] if problem.int8 else [])]
        space.in_backward = [False] + ([True] if "step-in-backward" in allowed else [])
        space.fractions = [0.0] + (list(PARTIAL_FRACTIONS) if problem.cuda and "offload-optimizer" in allowed else [])

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        if fixed.optimizer is not None:
            space.placements = [fixed.optimizer]
        if fixed.state_precision is not None:
            space.states = [fixed.state_precision]
        if fixed.step_in_backward is not None:
            space.in_backward = [fixed.step_in_backward]
        if fixed.offload_fraction is not None:
            space.fractions = [fixed.offload_fraction]

    def setup_text(self, setup: Any) -> str:
        """E.g. "AdamW offloaded, bf16 moments, step in backward": the class, where its state lives (parameter
        offload offloads it), its moments (a named class: its own state) and its step."""
        o = setup.optimizer
        where = ("offloaded" if offloads_optimizer(o.placement, setup.offload_weights) else
                 f"{100 * o.offload_fraction:.0f}% offloaded" if o.offload_fraction else "on the device")
        state = f"{o.state_precision or 'fp32'} moments" if o.named.is_adamw else "its own state"
        weights = ", bf16 device weights" if o.placement == "offload-bf16-weights" else ""
        return f"{o.named.text} {where}{weights}, {state}" + (", step in backward" if o.step_in_backward else "")

    def chosen(self, settings: Any) -> dict[str, Any]:
        """The class, placement, moments, step and share offloaded, as an ``OptimizerChoice``'s fields (a named class:
        its own state; offloaded: no share; a share on the host implies the device placement, which the command
        line's --no-offload-optimizer would contradict: left to it)."""
        named, fraction = settings.optimizer_class, settings.offload_fraction
        placement = None if settings.optimizer == "device" and fraction else settings.optimizer
        return {"optimizer": {
            "placement": placement, "state_precision": settings.state_precision if named.is_adamw else None,
            "step_in_backward": settings.step_in_backward,
            "offload_fraction": settings.offload_fraction if settings.optimizer == "device" else None,
            "name": None if named.is_adamw else named.cls or named.path, "kwargs": dict(named.kwargs) or None}}

    def computes_in(self, choices: Any) -> tuple[str, str] | None:
        if choices.optimizer.placement == "offload-bf16-weights":
            return "bf16-mixed", "the offloaded optimizer's bf16 device weights compute in bf16"
        return None

    def kept(self, kept: Any) -> dict[str, Any]:
        """The placement, moments, step, offloaded share and class the state was built with."""
        return {"optimizer": kept.optimizer, "state_precision": kept.state_precision,
                "step_in_backward": kept.step_in_backward, "offload_fraction": kept.offload_fraction,
                "optimizer_class": kept.optimizer_class}

    def planned_setup(self, record: Any) -> dict[str, Any]:
        """The placement, moments, step and class; a share offloaded only where it is one (0 and out of [0, 1]: none,
        the latter named by ``settings_problems``)."""
        fraction = record.offload_fraction
        return {"placement": record.optimizer, "state_precision": record.state_precision,
                "step_in_backward": record.step_in_backward, "optimizer": record.optimizer_class,
                "offload_fraction": fraction if fraction is not None and 0 < fraction <= 1 else None}

    def settings_problems(self, settings: Any) -> list[str]:
        problems = []
        if settings.optimizer not in ("device", *OFFLOADED):
            problems.append(f"optimizer={settings.optimizer!r} is not one of 'device', "
                            f"{', '.join(map(repr, OFFLOADED))}. To resolve this error, pass one of them.")
        if settings.state_precision not in STATE_PRECISIONS:
            problems.append(Message(f"{arg('state_precision', settings.state_precision)} is not one of "
                                    f"{', '.join(STATE_PRECISIONS)}. To resolve this error, pass one of them."))
        if not 0.0 <= settings.offload_fraction <= 1.0:
            problems.append(Message(f"{arg('offload_fraction', settings.offload_fraction)}: a share in [0, 1] of a "
                                    "device optimizer's state. To resolve this error, pass one."))
        return problems

    def unbuildable(self, fixed: Any, micro_batch_size: int | None, world_size: int, fsdp: bool | None) -> str:
        """Why the search found no set-up where a plan's ``fixed`` choices rule out every one, naming them: the
        optimizer's fixed choices are what the search's own pruning can leave with nothing."""
        chosen = {k: v for k, v in (("optimizer", fixed.optimizer), ("state_precision", fixed.state_precision),
                                    ("step_in_backward", fixed.step_in_backward),
                                    ("offload_fraction", fixed.offload_fraction),
                                    ("micro_batch_size", micro_batch_size)) if v is not None}
        given = ", ".join(arg(k, v) for k, v in chosen.items()) or "the techniques allowed"
        ranks = f" with {arg('world_size', world_size)}{' (FSDP2)' if fsdp else ''}" if world_size > 1 or fsdp else ""
        lean = fixed.state_precision not in (None, "fp32")
        why = [text for text, applies in (
            ("FSDP2 shards fp32 moments only (torch's AdamW steps its sharded parameters)", lean and bool(fsdp)),
            (f"a step in backward or a partial offload: {marked(GRADIENTS_BEFORE_DDP.why).rstrip('.')}",
             world_size > 1 and bool(fixed.step_in_backward or fixed.offload_fraction))) if applies]
        why = why or ["the search's own pruning leaves none of them"]
        return Message(f"no set-up can be built from {given}{ranks}: {'; '.join(why)}. To resolve this error, drop "
                       "one of the fixed choices (leave it to the plan).")

    def host_fraction(self, settings: Any) -> float:
        """The share of the parameters whose state (and gradients) a plan's set-up keeps in host RAM: all of it
        offloaded, its offloaded share on the device."""
        return 1.0 if settings.optimizer != "device" else settings.offload_fraction

    def planned_text(self, settings: Any) -> str:
        """The optimizer in words, e.g. "device, int8 moments, step in backward": its placement (or its offloaded
        share), its class where not AdamW, its moments and step, and what pure bf16 and streamed weights change of
        what it keeps."""
        s = settings
        parts = [s.optimizer if not (s.optimizer == "device" and s.offload_fraction) else
                 f"{100 * s.offload_fraction:.0f}% offloaded"]
        if not s.optimizer_class.is_adamw:
            parts.insert(0, s.optimizer_class.text)
        if s.state_precision != "fp32":
            parts.append(f"{s.state_precision} moments")
        if s.step_in_backward:
            parts.append("step in backward")
        if s.pure_bf16:
            parts.append("pure bf16 (no master)")
        if s.offload_weights:
            parts.append("weights streamed")
        return ", ".join(parts)

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        """Each placement, moment precision, step (after backward, in it) and share offloaded the space keeps; the
        rules then drop what does not go together (an offloaded optimizer neither steps in backward nor offloads a
        share). The run's class, never the search's."""
        return [{"optimizer": placement, "state_precision": state, "step_in_backward": sib, "offload_fraction": fraction,
                 "optimizer_class": fixed.optimizer_class}
                for placement in space.placements for state in space.states for sib in space.in_backward
                for fraction in space.fractions]

    def skips(self, configuration: Any, fixed: Any, run: SearchRun) -> bool:
        """Lean moments with FSDP2 (torch's AdamW steps its sharded parameters); lean moments with a partial
        offload unless both are asked for (the search's own partial offloads keep fp32 moments: a quarter of the
        candidates); a step in backward with accumulation, unless asked for: the earlier micro-batches' gradients
        stay, so it saves no bytes (asked for, it steps in the last micro-batch's backward)."""
        c = configuration
        lean = c.state_precision != "fp32"
        asked_partial = fixed.offload_fraction is not None and fixed.state_precision is not None
        return ((lean and (c.distribution == "fsdp2" or (bool(c.offload_fraction) and not asked_partial)))
                or (c.step_in_backward and c.accumulation > 1 and not fixed.step_in_backward))

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        """The optimizer ``estimate`` traces: the ``optimizer=`` argument, or the class the set-up names, offloaded
        ("adamw-offload", or a named class's whole state in host RAM) where the set-up places it there; and AdamW's
        moments, step and offloaded share. Parameter offload's implied placement is the optimizer's to trace here
        (the options it changes are the optimizer's). Where the set-up and the argument contradict, AdamW's options
        keep their defaults."""
        choice = setup.optimizer  # an OptimizerChoice
        options: dict[str, Any] = {
            "optimizer": optimizer, "state_precision": choice.state_precision or "fp32",
            "offload_fraction": choice.offload_fraction or 0.0, "step_in_backward": bool(choice.step_in_backward)}
        problems = []
        lean = choice.state_precision not in (None, "fp32") or bool(choice.offload_fraction) or bool(
            choice.step_in_backward)  # memtrain.optim's AdamW rather than torch's
        offloaded = offloads_optimizer(choice.placement, setup.offload_weights)
        if choice.placement == "offload-bf16-weights":  # the device's weights: bf16 casts of the host master
            options["weights_dtype"] = "bf16"
        if not choice.named.is_adamw:  # a named class, wrapped as memtrain's AdamW is (offloaded: all of its state)
            if optimizer != "adamw":
                problems.append(f"setup.optimizer.name={choice.named.path!r} with optimizer={optimizer!r}: two "
                                "optimizers for one step. To resolve this error, pass one of them.")
            options["optimizer"] = choice.named
            if offloaded:
                options["offload_fraction"] = 1.0
        elif offloaded and optimizer == "adamw":
            options["optimizer"] = "adamw-offload"
        elif offloaded and optimizer != "adamw-offload":
            placed = choice.placement or "offload"  # None: parameter offload's
            problems.append(f"setup.optimizer.placement={placed!r} with optimizer={optimizer!r}: the offloaded "
                            "optimizer is AdamW (CPUOffloadOptimizer). To resolve this error, pass optimizer='adamw', "
                            f"or drop placement={placed!r}.")
        elif (choice.placement == "device" or choice.offload_fraction or choice.step_in_backward) and (
                optimizer == "adamw-offload"):  # lean moments go with either placement
            asked = [arg(name, getattr(choice, name)) for name in ("placement", "state_precision", "step_in_backward",
                                                                   "offload_fraction") if getattr(choice, name)]
            problems.append(Message(f"setup.optimizer {', '.join(asked)} with optimizer='adamw-offload': those choose "
                                    "AdamW on the device, 'adamw-offload' puts all of its state in host RAM. To resolve "
                                    "this error, pass optimizer='adamw', or drop them."))
        elif lean and optimizer not in ("adamw", "adamw-offload"):  # lean moments are the offloaded AdamW's too
            problems.append(Message(f"setup.optimizer's {arg('state_precision')}, {arg('step_in_backward')} and "
                                    f"{arg('offload_fraction')} are options of AdamW (memtrain.optim), not of "
                                    f"optimizer={optimizer!r}. To resolve this error, pass optimizer='adamw', or drop "
                                    "them."))
        if problems:
            options.update(state_precision="fp32", offload_fraction=0.0, step_in_backward=False)
        return options, problems

    def planned_options(self, settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
        """The optimizer as planned: memtrain's AdamW on the device or offloaded (its moments, partial offload, step
        in backward), or the run's class (offloaded: all of its state on the host); bf16 weights on the device where
        an offloaded fp32 master or pure bf16 keeps them so."""
        named, offloaded = settings.optimizer_class, settings.optimizer != "device"
        optimizer: Any = ("adamw-offload" if offloaded else "adamw") if named.is_adamw else named
        fraction = 1.0 if offloaded and not named.is_adamw else settings.offload_fraction
        bf16 = settings.optimizer == "offload-bf16-weights" or settings.pure_bf16
        return {"optimizer": optimizer, "state_precision": settings.state_precision, "offload_fraction": fraction,
                "step_in_backward": settings.step_in_backward, "weights_dtype": "bf16" if bf16 else None}

    def trainer_host_optimizer(self, choices: Any) -> tuple[NamedOptimizer, dict[str, Any]] | None:
        """Where the Trainer helper builds ``CPUOffloadOptimizer`` (placement "offload"; None: the Trainer's own
        optimizer): the class it steps on the host, and the keyword arguments it takes of ``choices`` (AdamW's lean
        moments; a named class takes its own)."""
        optimizer = choices.optimizer
        if optimizer.placement not in OFFLOADED:
            return None
        if not optimizer.named.is_adamw:
            return optimizer.named, {}
        return optimizer.named, {"state_precision": optimizer.state_precision or "fp32"}

    def trainer_problems(self, choices: Any) -> list[str]:
        """The Trainer builds its own AdamW on the device and steps after backward: lean moments and another class
        only offloaded (``CPUOffloadOptimizer``), no step in backward, no partial offload."""
        optimizer = choices.optimizer  # an OptimizerChoice
        problems = []
        if optimizer.placement == "offload-bf16-weights":
            problems.append(Message(f"{arg('optimizer.placement', 'offload-bf16-weights')}: MemtrainTrainer trains the "
                                    "model's own weights (CPUOffloadOptimizer copies the fp32 master back into them). "
                                    f"To resolve this error, pass {arg('optimizer.placement', 'offload')} (or train "
                                    "with `memtrain train`, which does)."))
        elif optimizer.state_precision is not None and optimizer.placement != "offload":
            problems.append(Message(f"{arg('optimizer.state_precision', optimizer.state_precision)}: the Trainer's "
                                    "AdamW keeps its moments in its own dtype; MemtrainTrainer builds memtrain.optim's "
                                    "lean moments only on the host. To resolve this error, add placement='offload' "
                                    f"(CPUOffloadOptimizer), drop {arg('state_precision')} (or train with `memtrain "
                                    "train`, which does)."))
        if not optimizer.named.is_adamw and optimizer.placement not in OFFLOADED:
            problems.append(Message(f"{arg('optimizer.name', optimizer.named.path)} on the device: the Trainer builds "
                                    "its own optimizer there. To resolve this error, name it in the TrainingArguments "
                                    "(optim=...) or pass Trainer(optimizers=...), or add placement='offload' "
                                    "(CPUOffloadOptimizer steps the class on the host)."))
        if optimizer.step_in_backward:
            problems.append(Message(f"{arg('optimizer.step_in_backward', True)}: the Trainer steps after backward and "
                                    "clips through the accelerator; MemtrainTrainer cannot step each parameter inside "
                                    f"backward. To resolve this error, drop {arg('step_in_backward')} (or train with "
                                    "`memtrain train`)."))
        if optimizer.offload_fraction:
            problems.append(Message(f"{arg('optimizer.offload_fraction', text=str(optimizer.offload_fraction))}: "
                                    "MemtrainTrainer offloads all of the optimizer state or none. To resolve this "
                                    "error, pass OptimizerChoice(placement='offload') (all of it) or drop "
                                    f"{arg('offload_fraction')}."))
        return problems


    def kept_differences(self, choices: Any, kept: Any) -> list[tuple[str, str]]:
        """The class (its name, else its kwargs), the placement (bf16 device weights included: the plan keeps the
        run's), the moments, the step in backward and the share offloaded: another one cannot take the state the
        run's left."""
        asked = choices.optimizer
        fields = (("placement", asked.placement, kept.optimizer),
                  ("state_precision", asked.state_precision, kept.state_precision),
                  ("step_in_backward", asked.step_in_backward, kept.step_in_backward),
                  ("offload_fraction", asked.offload_fraction, kept.offload_fraction))
        differ = [(Message(arg(f"optimizer.{name}", value)), Message(arg(f"optimizer.{name}", WHATEVER)))
                  for name, value, have in fields if value is not None and value != have]
        if asked.name is not None and asked.named.path != kept.optimizer_class.path:
            # As the run was given it ('sgd', a dotted path; a class: its path)
            given = asked.name if isinstance(asked.name, str) else asked.named.path
            differ.insert(0, (Message(arg("optimizer.name", given)),
                              Message(arg("optimizer.name", WHATEVER))))
        elif asked.kwargs is not None and asked.named.kwargs != kept.optimizer_class.kwargs:
            differ.insert(0, (Message(arg("optimizer.kwargs", dict(asked.named.kwargs))),
                              Message(arg("optimizer.kwargs", WHATEVER))))
        return differ


TECHNIQUE = OptimizerTechnique()
