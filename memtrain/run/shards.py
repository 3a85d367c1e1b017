"""Sharded checkpoints: under FSDP2 each rank writes its own shards of the weights and the optimizer state
(``torch.distributed.checkpoint``, DCP) into the checkpoint being assembled, so no rank ever holds the whole state;
a restore reads them into whatever layout the run has now (FSDP2 over any number of ranks, DDP, one process), DCP
resharding as it reads.

The checkpoint stays one folder, renamed into place when complete and checksummed file by file
(``memtrain.run.checkpoints``): rank 0 makes the temporary folder and tells the others its path, every rank writes
and hashes its shards, rank 0 writes the rest and the sums of all of them. The run folder must therefore be one
folder for every rank: on several nodes, shared storage.
"""

from __future__ import annotations

import functools
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memtrain.errors import ConfigError, MemtrainError
from memtrain.files import sha256_file
from memtrain.message import arg
from memtrain.quantize import quant_state_dict
from memtrain.run.checkpoints import SHARDS, CheckpointDamaged, RunCheckpoints, RunWriteError, write_fault


def save_shards(checkpoints: RunCheckpoints | None, step: int, state: dict[str, Any], model: nn.Module,
                optimizer: torch.optim.Optimizer, device: torch.device | None) -> None:
    """Writes the checkpoint of ``step``: each rank's shards of ``model`` and ``optimizer`` (collective: every rank
    calls it), and ``state``'s other entries by rank 0, the one with ``checkpoints``. ``device``: the one the run
    computes on (NCCL's objects travel through it).

    Raises:
        RunWriteError: the checkpoint's folder or a file of it could not be written, on every rank (the
            checkpoints already there are untouched).
    """
    # Imported here: only FSDP2 runs need it, and it takes about 0.6 s to import.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    box: list[Any] = [None]
    if checkpoints is not None:
        try:
            box = [str(checkpoints.begin(step))]
        except RunWriteError as e:
            box = [e]
    dist.broadcast_object_list(box, src=0, device=device if "nccl" in dist.get_backend() else None)
    if isinstance(box[0], RunWriteError):
        raise box[0]
    tmp = Path(box[0])
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # 4-bit layers' quantisation state, which no DTensor shard carries: whole on every rank, written once.
        model_state.update(quant_state_dict(model))
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / SHARDS)
        del model_state, optimizer_state
        rank = dist.get_rank()
        # Each rank hashes what it wrote (its __<rank>_*.distcp; rank 0 the .metadata too), so no rank reads all.
        mine = {f"{SHARDS}/{p.name}": sha256_file(p) for p in sorted((tmp / SHARDS).iterdir())
                if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == ".metadata")}
        sums: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(sums, mine)
    except BaseException as e:
        if checkpoints is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        os_error = _os_error_of(e)
        if os_error is None:
            raise
        raise RunWriteError(write_fault(os_error, tmp / SHARDS, checkpoints)) from None
    # Rank 0 writes the rest and renames the folder into place; every rank learns how that went, so that a failure
    # there stops them all alike (the others would wait for rank 0 in the next collective).
    outcome: list[Any] = [None]
    failure = None
    if checkpoints is not None:
        try:
            checkpoints.finish(step, tmp, {**state, SHARDS: SHARDS}, {k: v for part in sums for k, v in part.items()})
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others are told
            failure, outcome = e, [f"rank 0 could not finish the checkpoint of step {step}: {e}"]
    dist.broadcast_object_list(outcome, src=0, device=device if "nccl" in dist.get_backend() else None)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise RunWriteError(outcome[0])


def _os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind a failed save (a full or read-only disk), where there is one: DCP gathers every rank's
    failure into one CheckpointException, raised on every rank."""
    if isinstance(e, OSError):
        return e
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return None
    return next((f[0] for f in failures.values() if isinstance(f, tuple) and isinstance(f[0], OSError)), None)


def load_shards(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Reads a sharded checkpoint's weights and optimizer state (its ``SHARDS`` folder, ``path``) into ``model`` and
    ``optimizer`` as they are laid out now: FSDP2 over any number of ranks, DDP or one process (collective under
    torch.distributed).

    Raises:
        ConfigError: the optimizer keeps its state in a layout of its own (memtrain's CPUOffloadOptimizer, one
            process's offloaded optimizer), which the shards of a torch optimizer do not fill.
        CheckpointDamaged: the shards do not read into the model (damaged, or another model's).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from memtrain.optim import CPUOffloadOptimizer

    if isinstance(optimizer, CPUOffloadOptimizer):
        raise ConfigError(f"resume: the checkpoint holds FSDP2's shards of a torch optimizer's state, and this run's "
                          f"optimizer is memtrain's CPUOffloadOptimizer (one process, {arg('offload_optimizer', True)}), "
                          f"whose state has its own layout. To resolve this error, resume with {arg('fsdp', True)} "
                          f"under torchrun, as the run was started.")
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the optimizer's state made, to be filled
    # Under FSDP2 the 4-bit layers' quantisation state is no entry of the state dict (one process's state_dict has
    # it): read in place into the layers' own tensors, then left out of what the model loads.
    in_place = quant_state_dict(model)
    model_state.update(in_place)
    shards = {"model": model_state, "optimizer": optimizer_state}
    reader, planner = _unpickling_nothing()
    try:
        dcp.load(shards, storage_reader=reader(path), planner=planner())
    except (CheckpointException, MemtrainError, OSError, RuntimeError, KeyError, ValueError,
            pickle.UnpicklingError) as e:
        raise CheckpointDamaged(f"its shards do not read ({type(e).__name__}: {str(e)[:300]})") from None
    for name in in_place:
        shards["model"].pop(name)
    set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])


def shard_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole weights a sharded checkpoint's shards (its ``SHARDS`` folder, ``path``) hold, read in one process
    (``memtrain export`` of a run that has no model.safetensors yet), by parameter name.

    Raises:
        CheckpointDamaged: the shards do not read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader, planner = _unpickling_nothing()
    try:
        metadata = reader(path).read_metadata().state_dict_metadata
        weights = {key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                   for key, m in metadata.items() if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        dcp.load({"model": weights}, storage_reader=reader(path), planner=planner())
    except (CheckpointException, OSError, RuntimeError, KeyError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointDamaged(f"its shards do not read ({type(e).__name__}: {str(e)[:300]})") from None
    return weights


# -- reading without unpickling anything but DCP's own records -----------------------------------------------------
# What DCP's .metadata pickles (torch 2.11-2.14): its metadata classes, the file map's entries, sizes, dtypes and
# layouts. Nothing else is built from a checkpoint: its files may come from anywhere (checksums only show damage).
_METADATA_CLASSES = {("torch", "Size"), ("pathlib", "PosixPath"), ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or module == "torch.distributed.checkpoint.metadata" or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a checkpoint's shards/.metadata names {module}.{name}, which is no part of "
                                     "DCP's metadata: it is not loaded")


@functools.cache
def _unpickling_nothing() -> tuple[type, type]:
    """(a storage reader, a load planner) of torch's DCP that build nothing from a checkpoint but its own records:
    the metadata through ``_MetadataUnpickler`` (torch's reader ``pickle.load``s it), the non-tensor entries (the
    optimizer's hyper-parameters) with ``weights_only=True`` (torch's planner loads them with ``False``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return Reader, Planner
