"""Data parallelism over several ranks: DDP (every rank holds the whole model, gradients all-reduced) or FSDP2
(parameters, gradients and the optimizer state sharded, blocks gathered as they run; with the optimizer offloaded,
the shards in host RAM: ``shards_on_host``). ``TrainConfig.fsdp`` (and ``plan(fsdp=)``) chooses it, or the plan
compares the two; it has no ``Choices`` field, and its rules with the other techniques are theirs (the optimizer's,
pure bf16's, parameter offload's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace


def shards_on_host(s: Any) -> bool:
    """Whether FSDP2 keeps each rank's shards in host RAM and the optimizer steps them there (``CPUOffloadPolicy``):
    the optimizer offloaded under FSDP2, whose weights are then streamed (``FSDP_OFFLOAD_STREAMS``). ``s``: a plan's
    settings or a configuration."""
    return s.distribution == "fsdp2" and s.optimizer == "offload"


# -- FSDP2's host offload: its share of a candidate's bytes and seconds (the planner's cost model composes them) ---
def root_parameter_bytes(prof: Any) -> float:
    """The parameters outside the blocks (embeddings, the last norm, the head), frozen ones too, as traced: FSDP2's
    root group, which it gathers in forward and keeps gathered to the end of backward (the root does not reshard
    after forward)."""
    return float(prof.gathered_bytes[-1, 0])


def root_trainable_bytes(prof: Any) -> float:
    """The root group's trainable parameters as traced: the gradients it reduce-scatters at the end of backward."""
    return float(prof.trainable_bytes - np.sum(prof.block_parameter_bytes))


def sharded_host_bytes(prof: Any, state_bytes: float, world: int, pinned: bool) -> float:
    """One rank's host RAM under FSDP2's host offload: its shard of every parameter as stored (the fp32 master; a
    frozen one too, a 4-bit layer's packed codes), of the gradients (reduce-scattered in fp32, then copied there) and
    of the optimizer's state (``state_bytes``: the whole state). ``pinned`` (CUDA): each parameter's shard (frozen
    ones too) and each gradient's are pinned, which torch's host allocator rounds up to a power of two (and keeps);
    the state is plain memory. A 4-bit layer's quantisation state stays on the device."""
    if not pinned:
        return (prof.parameter_bytes - prof.replicated_bytes + prof.trainable_bytes + state_bytes) / world
    key = ("pinned shards", world)
    if key not in prof.memo:
        prof.memo[key] = float(sum((2 if trainable else 1) * _power_of_two(-(-n // world) * d.itemsize)
                                   for n, d, trainable in prof.sharded_params))
    return prof.memo[key] + state_bytes / world


def _power_of_two(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


def sharded_host_copies(prof: Any, world: int) -> tuple[float, float]:
    """(bytes to the device per micro-batch, those waited for before the first block runs), per rank, under FSDP2's
    host offload: FSDP2 copies each rank's shard as it is stored (4 bytes a parameter for an fp32 master; the
    offloaded optimizer's own bf16 device copies would take 2) before gathering it: each block's in forward and
    again in backward (blocks reshard after forward), the root's once."""
    blocks = float(np.sum(prof.gathered_bytes[:-1, 0])) / world
    root = root_parameter_bytes(prof) / world
    return 2 * blocks + root, root + float(prof.gathered_bytes[0, 0]) / world


def sharded_host_micro_seconds(prof: Any, world: int, micro: np.ndarray, moved: np.ndarray,
                               host_to_device: float) -> np.ndarray:
    """A micro-batch's seconds per row under FSDP2's host offload on CUDA: the shards' copies run ahead of the
    compute (FSDP2 prefetches the next block's), sharing the link with the offloaded activations (``moved`` bytes
    each way), so a micro-batch lasts as long as the longer of the two, plus the first copies, which nothing
    hides."""
    copies, first = sharded_host_copies(prof, world)
    return np.maximum(micro, (copies + moved) / host_to_device) + first / host_to_device


class DistributionTechnique(Technique):
    """DDP or FSDP2 over several ranks: the run's fsdp, or the plan's comparison."""

    name = "data parallelism"
    search = ()  # DDP or FSDP2 is the plan's argument (fsdp=None compares them)

    def reasons(self, view: PlanView) -> list[str]:
        """DDP or FSDP2 against the other, over several ranks; nothing for one."""
        if view.world <= 1:
            return []
        s = view.settings
        other = view.alternative(~view.same("distribution"), "FSDP2" if s.distribution == "ddp" else "DDP")
        return [f"{'DDP' if s.distribution == 'ddp' else 'FSDP2'} over {view.world} ranks"
                + (f", because: {other}" if other else " (as asked)")]

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """One process; over several ranks FSDP2 (fsdp=True), DDP (False), or both to compare (None)."""
        space.distributions = ["none"] if problem.world == 1 else (
            ["fsdp2"] if problem.fsdp else ["ddp"] if problem.fsdp is False else ["ddp", "fsdp2"])

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        return [{"distribution": distribution} for distribution in space.distributions]


TECHNIQUE = DistributionTechnique()
