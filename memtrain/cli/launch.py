"""How the process was launched: torchrun's environment (checked), the distributed group it asks for, and the
--nproc check (memtrain train starts no processes itself).

Under torchrun memtrain's arguments follow ``--`` (``torchrun --nproc_per_node 2 -m memtrain -- train --nproc 2``):
torchrun's parser reads every flag before it as a possible abbreviation of its own (``--nproc`` of
``--nproc-per-node``, ``--log`` of ``--log-dir``) and stops at "ambiguous option"; it passes what follows ``--`` on.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from memtrain.device import accelerator
from memtrain.errors import ConfigError, MemtrainError


def _launch_environment() -> tuple[int, int]:
    """(world size, local rank) from torchrun's environment, checked: a partial one is refused, not crashed on."""
    names = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
    values = {}
    for name in names:
        text = os.environ.get(name)
        if text is not None:
            try:
                values[name] = int(text)
            except ValueError:
                raise ConfigError(f"the environment variable {name}={text!r} is not an integer. To resolve this "
                                  f"error, unset {name} or launch with torchrun, which sets it.") from None
    world = values.get("WORLD_SIZE", 1)
    if world > 1:
        missing = [n for n in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
        if missing:
            raise ConfigError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                              " not: memtrain joins a distributed group only as torchrun starts it. To resolve this "
                              f"error, launch with torchrun --nproc_per_node {world} -m memtrain -- train ..., or unset "
                              "WORLD_SIZE.")
    elif world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1. To resolve this error, unset WORLD_SIZE.")
    rank = values.get("RANK", 0)
    if not 0 <= rank < world:  # WORLD_SIZE=1 RANK=3 too: a rank of a group that does not exist
        raise ConfigError(f"RANK={rank} is not in [0, WORLD_SIZE={world}). To resolve this error, launch with "
                          "torchrun, which sets both, or unset RANK.")
    return world, values.get("LOCAL_RANK", 0)


RENDEZVOUS_TIMEOUT_S = 120.0  # how long rank 0 waits for its peers (and a peer for rank 0) before giving up
RENDEZVOUS_TIMEOUT_ENV = "MEMTRAIN_RENDEZVOUS_TIMEOUT"  # seconds, overriding RENDEZVOUS_TIMEOUT_S


def _rendezvous_timeout() -> float:
    text = os.environ.get(RENDEZVOUS_TIMEOUT_ENV)
    if text is None:
        return RENDEZVOUS_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{RENDEZVOUS_TIMEOUT_ENV}={text!r} must be a number of seconds > 0. To resolve this "
                          f"error, set it to e.g. 300, or unset it ({RENDEZVOUS_TIMEOUT_S:.0f} s).")
    return seconds


def _join_group(backend: str, world: int) -> None:
    """init_process_group, with a rendezvous that gives up after ``_rendezvous_timeout()`` seconds, naming who
    is missing, instead of waiting silently for torch's 30 minutes; the collectives keep torch's timeout."""
    seconds = _rendezvous_timeout()
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, rank, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=seconds)))
    except (dist.DistError, RuntimeError, ValueError) as e:
        raise MemtrainError(
            f"RANK={os.environ['RANK']} of WORLD_SIZE={world} could not meet its peers at {address} within "
            f"{seconds:g} s ({' '.join(str(e).split())[:200]}). To resolve this error, start every rank (torchrun "
            f"--nproc_per_node {world} -m memtrain -- train ... starts them together), check MASTER_ADDR and "
            f"MASTER_PORT, or wait longer with {RENDEZVOUS_TIMEOUT_ENV}=SECONDS.") from None
    store.set_timeout(default_pg_timeout)  # what init_process_group's own rendezvous leaves it at
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world)


@contextlib.contextmanager
def distributed_group() -> Iterator[tuple[int, int, Any]]:
    """Joins the torchrun group when launched by torchrun; yields (rank, world size, device).

    The group this opens is closed here: after a barrier when the run succeeded, so no rank tears its
    connections down while a peer still uses them, and in any case before the interpreter exits (a gloo group
    left to interpreter shutdown can abort the process).
    """
    world, local_rank = _launch_environment()
    acc = accelerator()  # the machine's accelerator; the CPU (simulated under MEMTRAIN_SIMULATED_DEVICE) without
    real = acc.kind not in ("cpu", "simulated")
    device = torch.device(acc.device.type, local_rank) if real else acc.device
    opened = world > 1 and not dist.is_initialized()
    if opened:
        if real:
            torch.accelerator.set_device_index(local_rank)
        # CUDA tensors over NCCL, host tensors over gloo: FSDP2's host offload reduces its host shards' gradient
        # norm, which NCCL alone cannot (torchtitan and torchtune open the same pair).
        _join_group("cpu:gloo,cuda:nccl" if acc.kind == "cuda" else "gloo", world)
    try:
        yield (dist.get_rank() if dist.is_initialized() else 0), world, device
        if opened:
            dist.barrier()
    finally:
        if opened:
            gc.collect()  # a DDP reducer left in a reference cycle must not outlive the group it uses
            dist.destroy_process_group()


def nproc_problems(nproc: int) -> list[str]:
    """memtrain train --nproc N is a check: torchrun, not memtrain, starts the processes."""
    world, _ = _launch_environment()
    if nproc == world:
        return []
    if "WORLD_SIZE" not in os.environ:
        return [f"--nproc {nproc}: this is one process, not started by torchrun (memtrain train starts no "
                "processes itself). To resolve this error, launch torchrun --nproc_per_node "
                f"{nproc} -m memtrain -- train --nproc {nproc} ... (memtrain's flags after --: torchrun would read "
                "--nproc as an abbreviation of its own --nproc-per-node), or drop --nproc (with --resume, which "
                "reads it from the run: pass --nproc 1, and --no-fsdp for an FSDP2 run; its checkpoint reshards)."]
    return [f"--nproc {nproc}, but torchrun started WORLD_SIZE={world} processes. To resolve this error, pass "
            f"--nproc {world} (or drop it), or launch torchrun --nproc_per_node {nproc}."]


