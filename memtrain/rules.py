"""The rules between two techniques, each written once: its name, why the two cannot go together, and the fix.

A rule is checked where its inputs are known (``Choices`` at start-up, ``build_optimizer`` and
``CPUOffloadOptimizer`` when built directly, the planner's checks of fixed choices and hand-made set-ups) and obeyed
by the search, which never proposes what it refuses. Each site names its own arguments ("optimizer.step_in_backward"
in ``Choices``, "step_in_backward" in ``build_optimizer``) and may name its own fix; the reason is the rule's, so a
combination is refused for one reason, in the same words, wherever it is caught.

Example:
    >>> PURE_BF16_INT8.message("pure_bf16=True with state_precision='int8'")[:64]
    "pure_bf16=True with state_precision='int8': bitsandbytes' 8-bit "
    >>> gradients_before_ddp(step_in_backward=True, offload_fraction=0.0, several_processes=True)
    True
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One rule between techniques.

    name: a short identifier, e.g. "pure-bf16-int8".
    why: the reason, one sentence (the words every site's message shares).
    fix: the fix where a site names no better one, after "To resolve this error, ".
    """

    name: str
    why: str
    fix: str

    def message(self, given: str, fix: str | None = None) -> str:
        """The problem in words: ``given`` (the site's own arguments and values), the reason, then the fix."""
        return f"{given}: {self.why} To resolve this error, {fix or self.fix}."


# -- pure bf16 -------------------------------------------------------------------------------------------------
PURE_BF16_INT8 = Rule(
    "pure-bf16-int8",
    "bitsandbytes' 8-bit AdamW rounds a bf16 weight's update to nearest, losing updates below half an ulp (pure "
    "bf16 needs stochastic rounding).",
    "pass state_precision='bf16' or 'fp32', or drop pure_bf16")
PURE_BF16_PRECISION = Rule(
    "pure-bf16-precision",
    "pure bf16 keeps bf16 weights and computes in bf16 (no fp32 master, no fp16 loss scaling).",
    "pass precision='bf16-mixed', or drop pure_bf16")
PURE_BF16_FSDP = Rule(
    "pure-bf16-fsdp",
    "PureBF16AdamW slices whole bf16 parameters, not FSDP2's sharded ones.",
    "drop fsdp=True (DDP or one process), or drop pure_bf16")

# -- the optimizer's placement and its wrappers ----------------------------------------------------------------
GRADIENTS_BEFORE_DDP = Rule(
    "gradients-before-ddp",
    "DDP averages gradients after the hooks that act on them (a step in backward, a partial offload, gradients "
    "offloaded as produced), so each rank would step on its own gradient and the ranks' weights would drift apart.",
    "drop step_in_backward and offload_fraction, or run one process")
OFFLOAD_OPTIMIZER_FSDP = Rule(
    "offload-optimizer-fsdp",
    "FSDP2 shards the optimizer state itself and CPUOffloadOptimizer needs whole parameters.",
    "keep the optimizer on the device with FSDP2, or use DDP")
OFFLOAD_WITH_FRACTION = Rule(
    "offload-with-fraction",
    "the first puts all of the optimizer state in host RAM, the second a share of a device optimizer's.",
    "pass one of them")
OFFLOAD_WITH_IN_BACKWARD = Rule(
    "offload-with-step-in-backward",
    "the offloaded optimizer already takes each gradient off the device as it is produced and steps on the host; "
    "step_in_backward is for the device optimizer.",
    "pass one of them")
IN_BACKWARD_WITH_FRACTION = Rule(
    "step-in-backward-with-fraction",
    "a partial offload steps after backward.",
    "pass one of them")
IN_BACKWARD_FP16_SCALER = Rule(
    "step-in-backward-fp16-scaler",
    "an overflow must stop the parameters still to step on a flag read on the device, which only fused AdamW (fp32 "
    "moments) takes, not lean moments or another optimizer class.",
    "pass bf16-mixed precision (no scaler) or step_in_backward=False, or AdamW with state_precision='fp32'")
IN_BACKWARD_PER_PARAMETER = Rule(
    "step-in-backward-per-parameter",
    "its step needs every parameter's gradient (or a closure re-evaluating the loss), so a parameter cannot step "
    "alone as its gradient is final.",
    "use AdamW (build_optimizer's default) or pass step_in_backward=False")
BF16_WEIGHTS_PRECISION = Rule(
    "bf16-device-weights-precision",
    "its device weights are bf16 casts of the host master, which only bf16-mixed computes in.",
    "pass precision='bf16-mixed', or optimizer 'offload' (fp32 device weights)")

# -- parameter offload -------------------------------------------------------------------------------------------
OFFLOAD_WEIGHTS_DEVICE_OPTIMIZER = Rule(
    "offload-weights-device-optimizer",
    "the blocks' weights live in host memory as the offloaded optimizer's master, which a device optimizer has not.",
    "pass optimizer 'offload' (or 'offload-bf16-weights'), or drop offload_weights=True")
OFFLOAD_WEIGHTS_COMPILE = Rule(
    "offload-weights-compile",
    "parameter offload moves each block's weights in module hooks, which torch.compile would break the graph at.",
    "drop compile=True or offload_weights=True")
OFFLOAD_WEIGHTS_PURE_BF16 = Rule(
    "offload-weights-pure-bf16",
    "parameter offload streams the offloaded optimizer's fp32 master (or its bf16 cast), and pure bf16 keeps no "
    "master; the two are not built together yet.",
    "drop one of them")
OFFLOAD_WEIGHTS_ONE_PROCESS = Rule(
    "offload-weights-one-process",
    "parameter offload streams whole blocks to one device (FSDP2 shards and gathers them itself, and DDP averages "
    "gradients after they left for the host).",
    "run one process without fsdp=True, or drop offload_weights=True")

# -- the optimizer's class --------------------------------------------------------------------------------------
NAMED_OWN_STATE = Rule(
    "named-optimizer-own-state",
    "lean moments and pure bf16 are memtrain's AdamW's; another optimizer class keeps its own state.",
    "drop them, or use the 'adamw' optimizer")

# -- activation checkpointing and offload ------------------------------------------------------------------------
CHECKPOINT_OFFLOAD_INPUTS = Rule(
    "checkpoint-offload-inputs",
    "the policy offloads the recomputed blocks' inputs, but offload_activations=False says not to.",
    "drop +offload or offload_activations=False")

RULES: tuple[Rule, ...] = (
    PURE_BF16_INT8, PURE_BF16_PRECISION, PURE_BF16_FSDP,
    GRADIENTS_BEFORE_DDP, OFFLOAD_OPTIMIZER_FSDP, OFFLOAD_WITH_FRACTION, OFFLOAD_WITH_IN_BACKWARD,
    IN_BACKWARD_WITH_FRACTION, IN_BACKWARD_FP16_SCALER, IN_BACKWARD_PER_PARAMETER, BF16_WEIGHTS_PRECISION,
    OFFLOAD_WEIGHTS_DEVICE_OPTIMIZER, OFFLOAD_WEIGHTS_COMPILE, OFFLOAD_WEIGHTS_PURE_BF16, OFFLOAD_WEIGHTS_ONE_PROCESS,
    NAMED_OWN_STATE, CHECKPOINT_OFFLOAD_INPUTS,
)


# -- the predicates: where a rule's inputs are plain values, whether it refuses them ------------------------------
def pure_bf16_int8(pure_bf16: bool | None, state_precision: object) -> bool:
    """PURE_BF16_INT8: pure bf16 with int8 moments."""
    return bool(pure_bf16) and state_precision == "int8"


def pure_bf16_precision(pure_bf16: bool | None, precision: object) -> bool:
    """PURE_BF16_PRECISION: pure bf16 with a precision that is not bf16-mixed (fp32, or fp16 with its scaler)."""
    return bool(pure_bf16) and precision in ("fp32", "fp16-mixed")


def in_backward_fp16_scaler(step_in_backward: bool | None, state_precision: object, adamw: bool,
                            precision: object) -> bool:
    """IN_BACKWARD_FP16_SCALER: a step in backward under fp16's scaler by an optimizer without fused AdamW's flag."""
    return bool(step_in_backward) and precision == "fp16-mixed" and (state_precision != "fp32" or not adamw)


def gradients_before_ddp(step_in_backward: bool | None, offload_fraction: float | None,
                         several_processes: bool) -> bool:
    """GRADIENTS_BEFORE_DDP: a step in backward or a partial offload where several processes average gradients."""
    return several_processes and bool(step_in_backward or offload_fraction)


def offload_optimizer_fsdp(offloaded: bool, fsdp: bool) -> bool:
    """OFFLOAD_OPTIMIZER_FSDP: the optimizer (all of its state) in host RAM under FSDP2."""
    return offloaded and fsdp


def in_backward_with_fraction(step_in_backward: bool | None, offload_fraction: float | None) -> bool:
    """IN_BACKWARD_WITH_FRACTION: a step in backward and a partial offload at once."""
    return bool(step_in_backward) and bool(offload_fraction)


def bf16_weights_precision(placement: str | None, precision: str) -> bool:
    """BF16_WEIGHTS_PRECISION: the offloaded optimizer's bf16 device weights outside bf16-mixed."""
    return placement == "offload-bf16-weights" and precision != "bf16-mixed"
