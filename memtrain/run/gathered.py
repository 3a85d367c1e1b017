"""The end of an FSDP2 run without the whole model on one rank: ``model.safetensors`` written one tensor at a time,
and what ``hf/`` needs read from it without a copy.

``get_model_state_dict(full_state_dict=True)`` (what transformers' ``save_pretrained`` calls under FSDP too) gathers
every weight onto rank 0 before anything is written: the whole model in rank 0's host RAM, the known cause of OOM
at the end of FSDP runs. Here every rank takes part in gathering one tensor (``DTensor.full_tensor``), rank 0 writes
it at its place in the file and lets it go, then the next: rank 0 holds one whole tensor at a time beside its
shards. The file is safetensors as ``safetensors.torch.save_file`` lays it out (tensors by alignment, then by name,
tied weights once), so every reader of ``model.safetensors`` reads it as before.

``hf/`` then comes from the file: a LoRA run's adapters are gathered whole (they are small), a full fine-tuning's
weights are the file's pages mapped into memory (``mapped_weights``: the kernel reads them in as ``save_pretrained``
copies them out, and may drop them again), so no second copy of the model is made either.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memtrain.files import atomic_write
from memtrain.quantize import quant_state_dict
from memtrain.run.checkpoints import RunCheckpoints, RunWriteError, write_faults

# safetensors' dtype names (its format's "dtype" field).
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def write_gathered_weights(path: Path | None, model: nn.Module, checkpoints: RunCheckpoints | None,
                           device: torch.device | None) -> None:
    """Writes the whole weights of the FSDP2-sharded ``model`` to ``path`` (rank 0's; None on the others), one tensor
    gathered at a time (collective: every rank calls it). Tied weights are written once, under their first name;
    4-bit layers' quantisation state beside their packed codes, as one process's ``state_dict`` has it.

    Raises:
        RunWriteError: the file could not be written, on every rank (rank 0 tells the others).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from memtrain.run.state import tied_duplicates

    state = {**get_model_state_dict(model), **quant_state_dict(model)}  # shards (DTensors) by name, no copy
    duplicates = tied_duplicates(model)
    entries = sorted(((name, t) for name, t in state.items() if name not in duplicates),
                     key=lambda entry: (-entry[1].element_size(), entry[0]))

    def gathered() -> Any:
        for name, t in entries:
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    failure: BaseException | None = None
    if path is not None:
        try:
            with write_faults(path, checkpoints):
                atomic_write(path, lambda tmp: _write(tmp, entries, gathered()))
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others are told
            failure = e
    else:
        for _ in gathered():  # the gathers rank 0 writes
            pass
    outcome: list[Any] = [None if failure is None else f"rank 0 could not write {path}: {failure}"]
    dist.broadcast_object_list(outcome, src=0, device=device if "nccl" in dist.get_backend() else None)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise RunWriteError(outcome[0])


def _write(tmp: Path, entries: list[tuple[str, torch.Tensor]], tensors: Any) -> None:
    """safetensors' layout: an 8-byte header length, the JSON header (padded to 8 bytes), the tensors back to back
    in the header's order. Every tensor of ``tensors`` is gathered even after a failed write: the other ranks wait
    for each gather."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in entries:
        nbytes = t.numel() * t.element_size()  # a DTensor's numel and shape are the whole tensor's
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    error: OSError | None = None
    with open(tmp, "wb") as f:
        try:
            f.write(len(blob).to_bytes(8, "little") + blob)
        except OSError as e:
            error = e
        for _, whole in tensors:
            if error is None:
                try:
                    f.write(whole.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                except OSError as e:
                    error = e
            del whole
    if error is not None:
        raise error


def gathered_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of the FSDP2-sharded ``model`` whole, on the host, by state-dict name (a LoRA run's
    adapters): rank 0's; the others get none (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = get_model_state_dict(model)
    out = {}
    for name in sorted(trainable & set(state)):
        t = state[name]
        whole = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
        if dist.get_rank() == 0:
            out[name] = whole
    return out


def hf_weights(path: Path, model: nn.Module, *, adapters: bool) -> dict[str, torch.Tensor] | None:
    """What rank 0 writes ``hf/`` of the FSDP2-sharded ``model`` from, once ``path`` (its model.safetensors) is
    written: with ``adapters`` and LoRA, the adapters gathered whole (collective); else the file's weights mapped
    (rank 0's; None on the others)."""
    from memtrain.hf import is_hf_model, is_lora
    from memtrain.unwrap import unwrap_model

    if adapters and is_lora(unwrap_model(model)):
        return gathered_trainable(model)
    return mapped_weights(path) if dist.get_rank() == 0 and is_hf_model(model) else None


def mapped_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, each a view of the file's pages mapped copy-on-write: no
    tensor is read until it is used, and the pages it is read into belong to the file (the kernel may drop them)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    length = int.from_bytes(mapped[:8], "little")
    header = json.loads(mapped[8:8 + length])
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if end == begin:  # frombuffer takes no empty range
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=start + begin)
        tensors[name] = flat.view(dtype).reshape(entry["shape"])
    return tensors
