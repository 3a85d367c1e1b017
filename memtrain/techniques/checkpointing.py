"""Activation checkpointing: the blocks that keep only their input and recompute the rest in backward (about one
extra forward of each such block), by a policy ("none", "all", "every:K", "selective", "blocks(RKO...)",
"blocks(RKO...)+selective", "...+offload") or, left ``None``, the plan's per-block keep / recompute / offload. Its
setting is ``Choices.checkpointing`` (a ``Checkpointing``); its flag is each command's own (each parses and defaults
it its way). Its rule with activation offload is activation offload's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from memtrain.checkpointing import Checkpointing, SelectivePolicy
from memtrain.errors import ConfigError
from memtrain.message import Message, arg, marked
from memtrain.techniques.activation_offload import offloads_layout
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace


def policy_of(value: Any) -> tuple[Checkpointing | None, list[str]]:
    """The policy ``value`` spells (None or "auto": the plan's), and the problems with it, each naming the fix."""
    if value is None or isinstance(value, Checkpointing):
        return value, []
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None, []
    if isinstance(value, (bool, int)):  # parse would read 3 as every:3, True as all: a choice names its policy
        return None, [Message(f"{arg('checkpointing', value)} is not a policy. To resolve this error, pass 'auto', "
                              "'none', 'all', 'every:K' (e.g. 'every:2'), 'selective', or a Checkpointing.")]
    try:
        return Checkpointing.parse(value), []
    except ConfigError as e:
        return None, [p if p.startswith("checkpointing") else Message(f"{arg('checkpointing', value)}: {marked(p)}")
                      for p in e.problems]


def check_selective(policy: Checkpointing) -> None:
    """ConfigError for a selective policy the planner cannot plan: other ops kept, or the inputs offloaded."""
    if policy.selective != SelectivePolicy():
        planned = dataclasses.replace(policy, selective=SelectivePolicy())
        raise ConfigError(f"{arg('checkpointing', str(policy))}: the planner's selective recompute keeps the outputs "
                          f"of {', '.join(SelectivePolicy().keep)}. To resolve this error, pass "
                          f"{arg('checkpointing', str(planned))}, or estimate this policy with memtrain estimate.")
    if policy.offload_inputs:
        whole = (Checkpointing(mode="all", offload_inputs=True) if policy.mode == "selective" else
                 dataclasses.replace(policy, selective=None))  # the recomputed blocks whole, their inputs offloaded
        either = (dataclasses.replace(policy, offload_inputs=False), whole)
        raise ConfigError(f"{arg('checkpointing', str(policy))}: the planner does not combine a selective recompute "
                          f"with offloaded inputs. To resolve this error, pass {str(either[0])!r} or "
                          f"{str(either[1])!r}.")


def _same_policy(checkpointing: Any, policy: Checkpointing) -> bool:
    """Whether ``estimate``'s ``checkpointing=`` argument leaves the policy to its set-up (its default, "none") or
    names the same one."""
    if isinstance(checkpointing, str) and checkpointing == "none":
        return True
    if isinstance(checkpointing, Mapping):
        return False
    try:
        return Checkpointing.parse(checkpointing) == policy
    except ConfigError:
        return False


class CheckpointingTechnique(Technique):
    """Per-block recompute (or offload) by a policy, or the plan's layout of keep / recompute / offload."""

    name = "activation checkpointing"
    fields = ("checkpointing",)
    search = ("checkpointing", "selective")  # per-block recompute, and the selective flavor of it

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """A fixed policy as the plan's layout of blocks (``choices``: a ``Choices``).

        The policy fixes each block's kind (``+offload``: the recomputed blocks' inputs offloaded).
        ``offload_activations=True`` with a fixed layout offloads what the layout keeps and the recomputed blocks'
        inputs; with the layout left to the plan it fixes how recomputed blocks recompute (inputs offloaded). On a CPU
        nothing is offloaded (activation offload's note says so).

        Raises:
            ConfigError: a selective policy the planner cannot plan.
        """
        policy = choices.checkpointing
        if policy is not None and policy.selective is not None:
            check_selective(policy)
        offload = offloads_layout(choices, device)  # True: what the layout keeps goes to the host too
        if policy is not None and device != "cuda":
            policy = dataclasses.replace(policy, offload_inputs=False)
        blocks, flavor = None, None
        if policy is not None:
            # A layout of the wrong length is named by the planner's check of the fixed choices, which knows the model.
            blocks = policy.blocks if policy.mode == "blocks" else policy.block_policies(n_blocks)
            flavor = ("selective" if policy.selective is not None else
                      "offload-inputs" if policy.offload_inputs or offload else "full")
            if offload:
                blocks = tuple("offload" if kind == "keep" else kind for kind in blocks)
        elif offload:
            flavor = "offload-inputs"  # the layout is the plan's; the blocks it recomputes offload their inputs
        return Fixing({"blocks": blocks, "flavor": flavor})

    def left_open(self, fixed: Any) -> list[str]:
        """What fixes this technique where the plan cannot choose it (``fixed``: a plan's ``Fixed``)."""
        return [Message(f"{arg('checkpointing', 'none')} (or another policy)")] if fixed.blocks is None else []

    def chosen(self, settings: Any) -> dict[str, Any]:
        """The layout as a policy: "none", "all" ("+offload"), "selective", or one letter per block (the recomputed
        ones "+selective" or "+offload" as the flavor has them)."""
        blocks, recomputes = settings.blocks, "recompute" in settings.blocks
        selective = SelectivePolicy() if recomputes and settings.flavor == "selective" else None
        offload_inputs = recomputes and settings.flavor == "offload-inputs"
        if set(blocks) <= {"keep"}:
            return {"checkpointing": Checkpointing(mode="none")}
        if set(blocks) == {"recompute"}:
            return {"checkpointing": Checkpointing(mode="selective") if selective else
                    Checkpointing(mode="all", offload_inputs=offload_inputs)}
        return {"checkpointing": Checkpointing(mode="blocks", blocks=blocks, selective=selective,
                                               offload_inputs=offload_inputs)}

    def reasons(self, view: PlanView) -> list[str]:
        """Which blocks recompute or offload, against keeping every activation and against fewer such blocks."""
        s = view.settings
        n_recompute, n_offload = s.blocks.count("recompute"), s.blocks.count("offload")
        if n_recompute == n_offload == 0:
            return [f"checkpointing none, because: keeping every activation fits {view.budget_text} and recomputing "
                    "or offloading a block only costs time"]
        others = view.same("micro_batch_size", "chunked_loss", "optimizer", "distribution", "compile")
        keep_all = (view.offload == 0) & (view.recompute == 0)
        fewer = others & view.same("flavor") & (view.offload + view.recompute < n_recompute + n_offload)
        what = {"full": "recomputed", "selective": "recomputed selectively (matmul and attention outputs kept)",
                "offload-inputs": "recomputed, their inputs in pinned host memory"}[s.flavor]
        parts = [f"{n_recompute} of {len(s.blocks)} blocks {what}" if n_recompute else "",
                 f"{n_offload} with every activation in pinned host memory" if n_offload else ""]
        why = view.alternative(others & keep_all, "keeping every block's activations")
        fewest = view.alternative(fewer & ~keep_all, "fewer blocks") if fewer.any() else ""
        because = "; ".join(r for r in (why, fewest) if r)  # none: the layout was fixed, nothing else was tried
        return [f"checkpointing: {', '.join(p for p in parts if p)}"
                + (f", because: {because}" if because else " (as asked)")]

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """Recomputed blocks recompute whole, selectively, or with their inputs in host memory (CUDA)."""
        if "checkpointing" in allowed:
            space.flavors = ["full", *(["selective"] if "selective" in allowed else []),
                             *(["offload-inputs"] if problem.cuda and "offload-activations" in allowed else [])]

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        """A fixed layout keeps its kinds of block; a fixed flavor its way of recomputing."""
        if fixed.blocks is not None:
            space.offload_blocks = "offload" in fixed.blocks
            space.flavors = [fixed.flavor or "full"] if "recompute" in fixed.blocks else []
        elif fixed.flavor is not None:
            space.flavors = [fixed.flavor]

    def setup_text(self, setup: Any) -> str:
        """The policy (estimate's set-up always has one: its ``checkpointing=`` argument's where unset)."""
        return f"checkpointing {setup.checkpointing}"

    def planned_text(self, settings: Any) -> str:
        """The blocks' kinds in short: none, all, selective, all+offload-inputs, or counts per kind."""
        blocks, n = settings.blocks, len(settings.blocks)
        counts = {kind: blocks.count(kind) for kind in ("keep", "recompute", "offload")}
        flavor = {"full": "", "selective": " selective", "offload-inputs": " (inputs offloaded)"}[settings.flavor]
        if counts["keep"] == n:
            return "none"
        if counts["recompute"] == n:
            return {"full": "all", "selective": "selective", "offload-inputs": "all+offload-inputs"}[settings.flavor]
        if counts["offload"] == n:
            return "offload all"
        parts = [f"{counts['recompute']} recompute{flavor}" if counts["recompute"] else "",
                 f"{counts['offload']} offload" if counts["offload"] else "",
                 f"{counts['keep']} keep" if counts["keep"] else ""]
        return ", ".join(p for p in parts if p) + f" of {n}"

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        """Each way recomputed blocks recompute (one, "full", where no block recomputes)."""
        return [{"flavor": flavor} for flavor in space.flavors or ["full"]]

    def trainer_default(self, choices: Any) -> dict[str, Any]:
        """Every block recomputed where the policy is open (the Trainer helper runs no plan)."""
        return {"checkpointing": Checkpointing(mode="all")} if choices.checkpointing is None else {}

    def trainer_arguments_problems(self, choices: Any, arguments: Any) -> list[str]:
        """The Trainer's own ``gradient_checkpointing`` would checkpoint again each block the policy checkpoints."""
        policy = choices.checkpointing
        if policy is None or policy.mode == "none" or not getattr(arguments, "gradient_checkpointing", False):
            return []
        return [f"MemtrainTrainer: TrainingArguments(gradient_checkpointing=True) and Choices(checkpointing="
                f"{str(policy)!r}) would checkpoint every layer twice that the policy checkpoints (each recompute "
                "recomputed again). To resolve this error, drop gradient_checkpointing from the TrainingArguments "
                "(memtrain's checkpointing replaces it)."]

    def prepare_model(self, model: Any, choices: Any, *, chunk_tokens: int) -> dict[str, Any]:
        """The policy applied to the model's blocks: the blocks it checkpoints."""
        if choices.checkpointing is None:
            return {}
        blocks = choices.checkpointing.apply(model)
        return {"checkpointed": tuple(blocks),
                "reasons": [f"checkpointing {str(choices.checkpointing)!r}: {len(blocks)} blocks checkpointed "
                            "(recomputed in backward as the policy says)"]}

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        """The set-up's policy where the ``checkpointing=`` argument leaves it to it or names the same one; two
        different policies are a problem (the argument is kept, so it is still checked)."""
        if setup.checkpointing is None:
            return {"checkpointing": checkpointing}, []
        if _same_policy(checkpointing, setup.checkpointing):
            return {"checkpointing": setup.checkpointing}, []
        return {"checkpointing": checkpointing}, [
            Message(f"{arg('checkpointing', checkpointing)} and setup.checkpointing={str(setup.checkpointing)!r} are "
                    "two different policies for one step. To resolve this error, pass one of them.")]

    def planned_options(self, settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
        """Each block's kind (recompute, offload, keep), the recomputed ones in the plan's flavor."""
        options: dict[str, Any] = {"policies": settings.policies(block_names)}
        if settings.flavor == "selective":
            options["selective"] = ("matmul", "attention")
        if settings.flavor == "offload-inputs" and "recompute" in settings.blocks:
            options["offload"] = True
        return {"checkpointing": options}


TECHNIQUE = CheckpointingTechnique()
