"""Parameter offload: the blocks' weights live in host memory (the offloaded optimizer's master or its bf16 cast)
and reach the device one block ahead of use, in forward and again in backward; the device holds the other
parameters and two blocks' weights. Its setting is ``Choices.offload_weights``; its rules with the other techniques
follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

import numpy as np

from memtrain.message import Message, arg
from memtrain.offload import PREFETCH_DEFAULT
from memtrain.setting import flag
from memtrain.techniques.distribution import shards_on_host
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule, SetUp
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace

FIELD = field(default=None, metadata=flag(
    "--offload-weights", "parameter offload: the blocks' weights in host RAM (the offloaded optimizer's master), "
    "each on the device only while in use, one block ahead; for weights that do not fit the device. Needs "
    "--offload-optimizer, one process or --fsdp (FSDP2's CPUOffloadPolicy: each rank's shard), no --compile "
    "({unset})", kind="switch"))



# -- its share of a candidate's bytes and seconds (the planner's cost model composes them) -------------------------
WEIGHTS_IN_FLIGHT = 1 + PREFETCH_DEFAULT  # the block in use and the one copying ahead of it


def streams(cfg: Any) -> bool:
    """Whether memtrain's ``WeightStreamer`` streams ``cfg``'s blocks: parameter offload in one process. Under FSDP2
    its host offload streams each rank's shards (its share: ``memtrain.techniques.distribution``)."""
    return bool(cfg.offload_weights) and not shards_on_host(cfg)


def weights_in_host_ram(cfg: Any) -> bool:
    """Whether ``cfg``'s weights live in host RAM, copied to the device block by block (``streams``, or FSDP2's host
    offload): the set-ups a plan confirms only where no other fits."""
    return bool(cfg.offload_weights)


def streamed_weight_bytes(prof: Any, cfg: Any) -> float:
    """Bytes of the blocks' weights (the device dtype) that parameter offload keeps in host RAM; 0 without it."""
    return float(np.sum(prof.block_parameter_bytes)) if streams(cfg) else 0.0


def weights_shift(prof: Any, cfg: Any) -> float:
    """What parameter offload changes at every moment of the step, on the device: the blocks' weights are gone but
    for ``WEIGHTS_IN_FLIGHT`` of the largest (the block in use and the next one copying; their gradients are the
    offloaded optimizer's, streamed to the host as they land, which the trace already counts)."""
    if not streams(cfg):
        return 0.0
    return WEIGHTS_IN_FLIGHT * float(np.max(prof.block_parameter_bytes)) - streamed_weight_bytes(prof, cfg)


def weights_host_bytes(prof: Any, cfg: Any) -> float:
    """Host RAM parameter offload adds: nothing where the weights stream from the fp32 master itself; beside a bf16
    cast, a gradient stage of their own (``CPUOffloadOptimizer.stream_weights``), 2 bytes a block parameter."""
    return streamed_weight_bytes(prof, cfg) if cfg.optimizer == "offload-bf16-weights" else 0.0


def weights_stall(ctx: Any, prof: Any, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """Seconds a micro-batch waits for block weights under parameter offload, per row (``WeightStreamer``, one block
    ahead). On CUDA the copies run on a side stream: block i+1's during block i's forward, block i-1's during block
    i's backward, so only the first block's copy (forward) and the last one's (backward: its copy starts at its own
    pre-backward hook) and a copy that outlasts the compute beside it are waited for. On a CPU the "copies" are
    memcpys on the compute thread, all waited for."""
    dev = ctx.device_profile
    blocks = np.asarray(prof.block_parameter_bytes, dtype=float)
    if ctx.device != "cuda":
        return np.full(fwd.shape[0], 2 * 2 * blocks.sum() / dev.memory_bandwidth)  # read and write, twice a pass
    copy = blocks / dev.host_to_device
    forward = copy[0] + np.maximum(0.0, copy[None, 1:] - fwd[:, :-1]).sum(axis=1)
    backward = copy[-1] + np.maximum(0.0, copy[None, :-1] - bwd[:, 1:]).sum(axis=1)
    return forward + backward


def weights_micro_seconds(ctx: Any, prof: Any, cfg: Any, micro: np.ndarray, fwd: np.ndarray, bwd: np.ndarray,
                          memo: Callable[[Any, Callable[[], Any]], Any], dev: Any, moved: np.ndarray,
                          gradient_bytes: float) -> np.ndarray:
    """A micro-batch's seconds per row with parameter offload's share added (unchanged without it): the waits for
    the weights (``weights_stall`` of the rows' blocks' forward and backward seconds, ``fwd`` and ``bwd``, computed
    once a layout through ``memo``), and on CUDA the link shared with the offloaded activations (``moved`` bytes
    each way) and gradients (``gradient_bytes`` to the host); ``dev``: the device profile at the compute
    precision."""
    if not streams(cfg):
        return micro
    micro = micro + memo("weights stall", lambda: weights_stall(ctx, prof, fwd, bwd))
    if ctx.device == "cuda":
        # The stalls are modelled one stream of copies at a time; together they share the link, so a micro-batch
        # lasts at least as long as its bytes take over it, each direction.
        streamed = 2 * streamed_weight_bytes(prof, cfg)
        micro = np.maximum(micro, np.maximum((moved + streamed) / dev.host_to_device,
                                             (moved + gradient_bytes) / dev.device_to_host))
    return micro


OFFLOAD_WEIGHTS_DEVICE_OPTIMIZER = Rule(
    "offload-weights-device-optimizer",
    "the blocks' weights live in host memory as the offloaded optimizer's master, so parameter offload needs the "
    "offloaded optimizer, which holds all of the state on the host and steps there after backward (never in "
    "backward, never a share of the state).",
    "drop {rest}, or drop {first}",
    ("offload_weights", "placement", "step_in_backward", "offload_fraction"),
    # An in-backward step or a share of the state in host RAM is a device optimizer where no placement is given.
    lambda s: bool(s.offload_weights) and (s.placement == "device" or s.placement is None and (
        bool(s.step_in_backward) or s.offload_fraction is not None)),
    shows_false=("offload_fraction",))
OFFLOAD_WEIGHTS_COMPILE = Rule(
    "offload-weights-compile",
    "parameter offload moves each block's weights in module hooks, which torch.compile would break the graph at.",
    "drop {rest} or {first}",
    ("offload_weights", "compile"),
    # NOTE: under FSDP2 too (its host offload is streamed weights): Choices, which knows no ranks, checks it alone.
    lambda s: bool(s.offload_weights) and bool(s.compile))
OFFLOAD_WEIGHTS_PURE_BF16 = Rule(
    "offload-weights-pure-bf16",
    "parameter offload streams the offloaded optimizer's fp32 master (or its bf16 cast), and pure bf16 keeps no "
    "master; the two are not built together yet.",
    "drop one of them",
    ("offload_weights", "pure_bf16"),
    lambda s: bool(s.offload_weights) and bool(s.pure_bf16))
OFFLOAD_WEIGHTS_ONE_PROCESS = Rule(
    "offload-weights-one-process",
    "parameter offload streams whole blocks to one device, and DDP averages gradients after they left for the host.",
    f"pass {arg('fsdp', True)} (FSDP2 streams each rank's shard from host RAM), run one process, or drop {{first}}",
    ("offload_weights", "processes"),
    lambda s: bool(s.offload_weights) and s.several_processes and not s.fsdp)
FSDP_OFFLOAD_STREAMS = Rule(
    "fsdp-offload-streams-weights",
    "FSDP2 keeps each rank's shards in host RAM, where the offloaded optimizer steps them, and copies each block to "
    "the device as it gathers it (CPUOffloadPolicy): the weights are streamed.",
    f"pass {arg('offload_weights', True)} or leave it to the plan, or drop one of {{rest}}",
    ("offload_weights", "placement", "fsdp"),
    lambda s: s.offload_weights is False and s.placement == "offload" and bool(s.fsdp),
    shows_false=("offload_weights",))
OFFLOAD_WEIGHTS_BLOCKS = Rule(
    "offload-weights-blocks",
    "parameter offload streams the model's repeated blocks one at a time, and auto found no repeated blocks in this "
    "model (no nn.ModuleList/nn.Sequential of one module type, no Hugging Face _no_split_modules).",
    "drop {first}",
    ("offload_weights", "has_blocks"),
    lambda s: bool(s.offload_weights) and s.has_blocks is False and not s.fsdp)  # FSDP2 offloads the root too


class WeightOffloadTechnique(Technique):
    """The blocks' weights in host memory, streamed: on, off, or the plan's (on CUDA)."""

    name = "parameter offload"
    fields = ("offload_weights",)
    rules = (OFFLOAD_WEIGHTS_DEVICE_OPTIMIZER, OFFLOAD_WEIGHTS_COMPILE, OFFLOAD_WEIGHTS_PURE_BF16,
                           OFFLOAD_WEIGHTS_ONE_PROCESS, FSDP_OFFLOAD_STREAMS, OFFLOAD_WEIGHTS_BLOCKS)
    search = ("offload-weights",)

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """Parameter offload on or off as given (None: the plan's, on CUDA only)."""
        return Fixing({"offload_weights": choices.offload_weights})

    def left_open(self, fixed: Any) -> list[str]:
        """Nothing to fix where the plan cannot choose: where no plan runs, the weights stay on the device unless
        asked for."""
        return []

    def reasons(self, view: PlanView) -> list[str]:
        """The line on parameter offload: why it was chosen, or why not where it was searched."""
        streamed = view.column("offload_weights").astype(bool)
        if view.settings.offload_weights:
            other = view.alternative(~streamed, "the weights on the device")
            what = ("each rank's shard of the weights in host RAM (FSDP2's, which the optimizer steps there), each "
                    "block copied to the device and gathered as it runs, in forward and again in backward"
                    if shards_on_host(view.settings) else
                    "the blocks' weights in host RAM (the optimizer's), two blocks on the device at a time, copied "
                    "one block ahead in forward and again in backward")
            return [f"parameter offload: {what}" + (f", because: {other}" if other else " (as asked)")]
        if streamed.any():
            return ["the weights on the device, because: they fit (parameter offload, the blocks' weights streamed "
                    "from host RAM, is tried only when no other set-up fits)"]
        return []

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """Parameter offload streams the weights from the offloaded optimizer's master: tried only beside it, on CUDA
        (on a CPU it saves nothing), and where the blocks' weights all train (a frozen base, LoRA's or a 4-bit one,
        stays on the device: streaming the adapters alone saves next to nothing), unless it is asked for. Under
        FSDP2 on any device: there the offloaded optimizer streams the weights (``FSDP_OFFLOAD_STREAMS``; the
        optimizer's placements on a CPU are the device alone unless the offloaded one is asked for)."""
        sharded = problem.world > 1 and problem.fsdp is not False
        space.weights = [False, True] if ({"offload-optimizer", "offload-weights"} <= allowed and (
            sharded or problem.cuda and problem.blocks_all_train)) else [False]

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        """Parameter offload off, and on where the space keeps it (its rules with the optimizer's placement, compile
        and the ranks prune the rest)."""
        return [{"offload_weights": streamed} for streamed in space.weights]

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        """Fixed on or off; on with the placement left open, only the placements that keep a host master. Off with
        pure bf16, which keeps no master to stream (OFFLOAD_WEIGHTS_PURE_BF16)."""
        if fixed.pure_bf16:
            space.weights = [False]
            return
        if fixed.offload_weights is None:
            return
        space.weights = [fixed.offload_weights]
        if fixed.offload_weights and fixed.optimizer is None:
            space.placements = [p for p in space.placements if not OFFLOAD_WEIGHTS_DEVICE_OPTIMIZER.refuses(
                SetUp(offload_weights=True, placement=p))] or ["offload"]

    def kept(self, kept: Any) -> dict[str, Any]:
        """Streamed weights stay streamed, and weights on the device stay there (the state holds them so)."""
        return {"offload_weights": kept.offload_weights}

    def planned_setup(self, record: Any) -> dict[str, Any]:
        return {"offload_weights": record.offload_weights}

    def chosen(self, settings: Any) -> dict[str, Any]:
        return {"offload_weights": settings.offload_weights}

    def setup_text(self, setup: Any) -> str:
        return "the blocks' weights streamed from host RAM" if setup.offload_weights else ""

    def trainer_problems(self, choices: Any) -> list[str]:
        """The Trainer moves the whole model to the device: no weights streamed from host memory."""
        if not choices.offload_weights:
            return []
        return [Message(f"{arg('offload_weights', True)}: the Trainer moves the whole model to the device, and "
                        "MemtrainTrainer does not stream the blocks' weights from host memory. To resolve this error, "
                        f"drop {arg('offload_weights')} (optimizer=OptimizerChoice(placement='offload') still keeps the "
                        "optimizer state and master weights in host memory), or train with `memtrain train "
                        "--offload-weights`.")]


    def kept_differences(self, choices: Any, kept: Any) -> list[tuple[str, str]]:
        """Streamed weights asked for (or refused) where the run keeps the other layout: they are the optimizer's."""
        if choices.offload_weights is not None and choices.offload_weights != kept.offload_weights:
            given = Message(arg("offload_weights", choices.offload_weights))
            return [(given, given)]
        return []


TECHNIQUE = WeightOffloadTechnique()
