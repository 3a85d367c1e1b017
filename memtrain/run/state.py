"""The state of a run: everything a bit-identical resume needs, saved to and restored from its checkpoints, and
the model's weights file."""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from memtrain.device import accelerator
from memtrain.errors import ConfigError
from memtrain.files import atomic_write
from memtrain.message import arg
from memtrain.planner.settings import PlanSettings
from memtrain.quantize import quant_state_dict
from memtrain.run.checkpoints import CHECKPOINT_DAMAGE, SHARDS, RunCheckpoints
from memtrain.run.identity import RunIdentity, compare_runs
from memtrain.run.shards import load_shards, save_shards
from memtrain.unwrap import is_fsdp2


def save_weights_file(state_dict: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Saves a model's state dict as safetensors, atomically; tied weights are stored once, under their first name
    (``safetensors.torch.load_model`` restores the ties)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    for name, value in state_dict.items():
        value = value.detach().cpu()
        # The tensor's own address, not its storage's: parameter offload's weights are views into one flat host
        # master, and views of equal shape there are different weights.
        key = (value.data_ptr(), tuple(value.shape), value.dtype)
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = value.contiguous()
    atomic_write(path, lambda tmp: safetensors.torch.save_file(tensors, str(tmp)))


@dataclass(frozen=True, kw_only=True)
class PlanCheck:
    """The plan against the device at a step: what it predicted, what the step measured, and the verdict. A
    checkpoint holds it (``to_dict``, the JSON report.json's "measurement" is), a resume reads it back."""

    log: str  # the line the run logs
    what: str | None = None  # "peak" (an accelerator's allocator) or "saved activations" (the CPU); None: no plan
    predicted_bytes: int | None = None
    measured_bytes: int | None = None
    relative_error: float | None = None  # predicted / measured - 1
    over_budget: bool = False
    step: int | None = None  # counted from 1; None: no plan to check
    replanning: bool = False  # the run re-plans with the shortfall measured_bytes - predicted_bytes
    peak_bytes: int | None = None  # the measured (on the CPU: corrected) peak against the budget; None: none

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, keys in the order the run has always written them (no "step" without a plan)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.step is None:
            del out["step"]
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PlanCheck:
        """What ``to_dict`` wrote (KeyError, TypeError: not one)."""
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class CheckpointExtra:
    """The loop's own bookkeeping in a checkpoint, handed back on resume: the plan the run follows and how it came
    to it. A checkpoint holds it as JSON (``to_dict``: its "extra")."""

    plan_settings: PlanSettings  # the plan in force (re-planned ones included): a resume continues on it
    plan_request: dict[str, Any]  # replan.plan_request(config): the fields that shaped it, as JSON values
    correction_bytes: int = 0  # the shortfall folded into every predicted peak so far
    plan_check: PlanCheck | None = None  # the step-2 check's verdict (plan_check.check_step); None: not yet
    replans: tuple[dict[str, Any], ...] = ()  # report.json's "replans" (replan.replan_record), oldest first

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (a checkpoint's "extra"), keys in the order the loop has always written them."""
        return {"plan_check": self.plan_check.to_dict() if self.plan_check is not None else None,
                "plan_settings": self.plan_settings.to_dict(),
                "plan_request": self.plan_request, "correction_bytes": self.correction_bytes,
                "replans": list(self.replans)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CheckpointExtra:
        """The bookkeeping ``to_dict`` wrote.

        Raises:
            ConfigError: settings that are not a plan's. KeyError, TypeError: a missing or unknown field.
        """
        check = values.get("plan_check")
        return cls(**{**values, "plan_settings": PlanSettings.from_dict(values["plan_settings"]),
                      "plan_check": PlanCheck.from_dict(check) if check is not None else None,
                      "replans": tuple(values.get("replans", ()))})


def save_run_state(checkpoints: RunCheckpoints | None, step: int, micro: int, model: nn.Module,
                   optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, accumulator: Any,
                   run: RunIdentity, extra: CheckpointExtra,
                   config: Mapping[str, Any] | None = None, device: torch.device | None = None) -> None:
    """Everything a bit-identical resume needs: weights, optimizer (offloaded state included), scheduler, fp16
    scaler, accumulator counters, the data position (the step) and each rank's random generators (``rng_state``:
    the next dropout masks). Collective under torch.distributed: every rank calls it, rank 0 (the one with
    ``checkpoints``) writes. ``device``: the one the run computes on (None: the current accelerator device)."""
    sharded = is_fsdp2(model)  # each rank writes its shards (memtrain.run.shards): no rank holds the whole state
    state = {
        "step": step,
        "micro_batch_size": micro,
        "run": run.to_dict(),  # what defines the run: a resume must match it to be the same run
        "config": dict(config or {}),  # the settings a resume may change (RESUME_POLICY "apply"), for its log
        "extra": extra.to_dict(),  # the loop's own bookkeeping, handed back on resume
        "model": None if sharded else model.state_dict(),
        "optimizer": None if sharded else optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "accumulator": accumulator.state_dict(),
        # Every rank's own generators (collective): under torchrun each rank draws its own dropout masks on its
        # own device, so a resume gives each rank back what it had, not rank 0's.
        "rng": {"ranks": _every_rank(rng_state(device))},
    }
    if sharded:
        save_shards(checkpoints, step, state, model, optimizer, device)
    elif checkpoints is not None:
        checkpoints.save(step, state)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank runs ahead of a checkpoint that is still being written


def tied_duplicates(model: nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (a tied head), all but the first."""
    first: dict[int, str] = {}
    duplicates = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            duplicates.add(name)
        first.setdefault(id(p), name)
    return duplicates


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    if is_fsdp2(model):
        # Imported here: only FSDP2 runs need it, and it takes about 0.6 s to import.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # Rank 0 holds the gathered state (the others none): with the 4-bit layers' quantisation state, which the
        # shards do not carry, it is what one process's state_dict would be.
        return {**state, **{k: v.cpu() for k, v in quant_state_dict(model).items()}} if state else state
    return model.state_dict()


def resume_run(checkpoints: RunCheckpoints, run: RunIdentity,
               restore: Callable[[int, dict[str, Any]], None]) -> tuple[int, dict[str, Any], list[str]]:
    """Restores the newest checkpoint that is intact and fits, checked against this run's identity ``run`` first
    (one ConfigError listing every difference: another seed, batch, data or model would not continue the same
    run). A checkpoint that cannot be read or restored is damaged: the previous one is tried.

    Args:
        run: this run's identity; ``lr`` and ``warmup_steps`` None where they are chosen automatically: the run's
            own are kept, not compared.
        restore: loads a checkpoint's (step, state) into the run's objects; whatever it raises marks it damaged.

    Returns:
        (step, state, the damaged checkpoints skipped, each with what is wrong with it).
    """
    now = run
    skipped: list[str] = []
    # Every rank reads the checkpoints: each hashes its share of a checkpoint's files (a sharded one's are many).
    for path, step, state in checkpoints.readable(collective=dist.is_available() and dist.is_initialized()):
        if step is None:
            skipped.append(f"{path.name}: {state}")
            continue
        try:
            saved = RunIdentity.from_dict(state["run"])
        except CHECKPOINT_DAMAGE as e:
            skipped.append(f"{path.name}: its run identity does not read ({type(e).__name__}: {str(e)[:200]})")
            continue
        ConfigError.raise_if(compare_runs(saved, now))
        try:
            restore(step, state)
        except ConfigError:  # raised on purpose (e.g. the run already reached max_steps): not damage
            raise
        except CHECKPOINT_DAMAGE as e:
            skipped.append(f"{path.name}: its state does not load ({type(e).__name__}: {str(e)[:200]})")
            continue
        return step, state, skipped
    raise checkpoints.none_intact(skipped)


def restore_run_state(step: int, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: Any, scaler: Any, accumulator: Any, device: torch.device | None = None) -> None:
    """Loads a checkpoint's state into the run's objects (raises what the objects raise on a state that does not
    fit them); ``device``: the one the run computes on, whose generator it restores (None: the current one). A
    sharded checkpoint's weights and optimizer state are read from its shards into the layout the run has now."""
    if state.get(SHARDS) is not None:
        load_shards(state[SHARDS], model, optimizer)
    elif is_fsdp2(model):
        # Imported here: only FSDP2 runs need it, and it takes about 0.6 s to import.
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if any(isinstance(key, int) for key in state["optimizer"].get("state", {})):
            raise ConfigError("resume: the checkpoint holds the whole optimizer state of a run without FSDP2 (by "
                              "parameter index), which does not read into FSDP2's shards. To resolve this error, "
                              f"resume without {arg('fsdp', True)}, as the run was started.")
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    accumulator.load_state_dict(state["accumulator"])
    restore_rng(state["rng"], device)


# -- random generators: what the next dropout masks are drawn from ------------------------------------------------
def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's random generators: the CPU's, Python's and the one of the accelerator device it computes on
    (``device``; None: the current device; under torchrun each rank's own; other devices' generators are no rank's),
    read through the device seam (a simulated device's too).

    Returns:
        ``{"torch": ..., "python": ..., "device_type": the accelerator's kind ("cuda", "simulated", ...) or None,
        "device": the device generator's state or None}``, which ``restore_rng`` takes back (inside
        ``{"ranks": [...]}``, one per rank).
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "device_type": None,
                             "device": None}
    acc = accelerator(device)
    generator = acc.get_rng_state()  # None where the device draws from the CPU's (the CPU, the simulated device)
    if generator is not None:
        state.update(device_type=acc.kind, device=generator)
    return state


def restore_rng(rng: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Sets this rank's random generators to what ``save_run_state`` saved for it: the CPU's, Python's and, where
    it saved one, the generator of the accelerator device it computes on now (``device``; None: the current one),
    whatever its index: a resume on a machine with fewer devices, or under another ``CUDA_VISIBLE_DEVICES``.
    A checkpoint written before the generators were saved per rank gives every rank its one state (as it did).

    A state saved on an accelerator this machine does not have is not set: nothing here draws from it (the run
    computes on another device, whose draws differ anyway). A rank the checkpoint holds no generators for (a
    resume on more ranks than the run had) keeps its own, as the run seeded them: its dropout masks are new ones.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    ranks = rng["ranks"] if "ranks" in rng else [_one_rank_of_format_1(rng, device)] * (rank + 1)
    if rank >= len(ranks):
        return
    mine = ranks[rank]
    torch.set_rng_state(mine["torch"])
    random.setstate(_as_tuples(mine["python"]))
    acc = accelerator(device)
    if mine["device"] is not None and acc.kind == mine["device_type"]:
        acc.set_rng_state(mine["device"])


def _every_rank(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state``, in rank order (collective under torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def _one_rank_of_format_1(rng: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    """A checkpoint written before the generators were saved per rank: rank 0's CPU and Python generators and every
    CUDA device's as rank 0's process saw them (its current device's is the one it drew from)."""
    cuda = list(rng.get("cuda") or [])
    acc = accelerator(device)
    index = (acc.device.index or 0) if acc.kind == "cuda" else 0
    return {"torch": rng["torch"], "python": rng["python"], "device_type": "cuda" if cuda else None,
            "device": cuda[index] if index < len(cuda) else None}


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
