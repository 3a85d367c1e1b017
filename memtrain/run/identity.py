"""What defines a run (``RunIdentity``, with the fingerprints of its data and model), and which changed settings a
resume refuses or applies."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from memtrain.message import Message, arg

# A dataset without a token stream that is not an in-memory list is hashed through this many evenly spaced
# examples at most: each is one __getitem__ (which may read a file or tokenise), paid at every start and resume.
FINGERPRINT_MAX_EXAMPLES = 65536


@dataclass(frozen=True, kw_only=True)
class DataFingerprint:
    """The training data as a resume checks it: its size and a SHA-256 of its contents."""

    examples: int
    sha256: str  # hex digest
    of: str  # what was hashed: "token stream", "every example" or "<N> sampled examples"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a checkpoint's ``run`` holds under "data"."""
        return {"examples": self.examples, "sha256": self.sha256, "of": self.of}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataFingerprint:
        return cls(examples=values["examples"], sha256=values["sha256"], of=values["of"])


@dataclass(frozen=True, kw_only=True)
class ModelFingerprint:
    """The model as a resume checks it: what a checkpoint's weights must fit."""

    class_name: str  # the model's class (JSON "class")
    shapes: dict[str, tuple[int, ...]]  # every parameter's name and shape, in the model's order

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a checkpoint's ``run`` holds under "model"."""
        return {"class": self.class_name, "shapes": {name: list(shape) for name, shape in self.shapes.items()}}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelFingerprint:
        return cls(class_name=values["class"], shapes={name: tuple(shape) for name, shape in values["shapes"].items()})


def data_fingerprint(dataset: Any) -> DataFingerprint:
    """The number of examples and a SHA-256 of the data's contents, for a resume to refuse other data.

    What is hashed: the whole token stream where the dataset exposes one (numpy ``tokens``, plus ``starts``,
    ``lengths`` and ``loss_mask`` for documents; a ``PackedRows`` through its ``documents`` and packing
    settings); else every example of a list or tuple, and of any other dataset up to
    ``FINGERPRINT_MAX_EXAMPLES`` examples (that many, evenly spaced, beyond). Each example counts by its whole
    content (``_hash_item``): tensors and arrays by dtype, shape and bytes, other values by type and value, so
    two datasets of the same length with other contents fingerprint differently.
    """
    digest = hashlib.sha256()
    source = dataset if _token_stream(dataset) else getattr(dataset, "documents", None)
    if _token_stream(source):
        for name in ("tokens", "starts", "lengths", "loss_mask"):
            array = getattr(source, name, None)
            if isinstance(array, np.ndarray):
                digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        if source is not dataset:  # rows built from the stream: how they were built is part of the data
            settings = {name: getattr(dataset, name) for name in ("seq_len", "pad_id", "ignore_index")
                        if isinstance(getattr(dataset, name, None), int)}
            digest.update(repr((type(dataset).__qualname__, sorted(settings.items()))).encode())
        of = "token stream"
    else:
        n = len(dataset)
        if isinstance(dataset, (list, tuple)) or n <= FINGERPRINT_MAX_EXAMPLES:
            indices: Any = range(n)
            of = "every example"
        else:
            indices = sorted({int(i) for i in np.linspace(0, n - 1, num=FINGERPRINT_MAX_EXAMPLES)})
            of = f"{len(indices)} sampled examples"
        for i in indices:
            _hash_item(digest, dataset[i])
    return DataFingerprint(examples=len(dataset), sha256=digest.hexdigest(), of=of)


def _token_stream(dataset: Any) -> bool:
    return isinstance(getattr(dataset, "tokens", None), np.ndarray)


def _hash_item(digest: Any, item: Any) -> None:
    """Feeds one example into ``digest``, type-tagged and length-prefixed so that no two different contents
    feed the same bytes ([[1, 2], [3]] and [[1], [2, 3]], int32 and float32 zeros, a (2, 3) and a (3, 2)).

    Tensors and arrays: dtype, shape and bytes; str/bytes/numbers/None: their repr; lists, tuples (named ones
    with their field names), dicts and dataclasses: their fields in order; any other object: its ``__dict__``,
    or its repr where it has none (a repr holding an address would make equal data differ: a refused resume,
    never a silent one)."""
    if isinstance(item, torch.Tensor):
        # The bytes through a uint8 view: bf16 (which numpy has not) has no .numpy() of its own.
        data = item.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(f"T{item.dtype}{tuple(item.shape)}".encode())
        digest.update(memoryview(data).cast("B"))
    elif isinstance(item, np.ndarray):
        digest.update(f"N{item.dtype.str}{item.shape}".encode())
        digest.update(memoryview(np.ascontiguousarray(item).reshape(-1)).cast("B"))
    elif item is None or isinstance(item, (str, bytes, bool, int, float, complex, np.generic)):
        text = repr(item).encode()
        digest.update(f"S{type(item).__qualname__}:{len(text)}:".encode() + text)
    elif isinstance(item, Mapping):
        digest.update(f"M{type(item).__qualname__}:{len(item)}:".encode())
        for key, value in item.items():
            _hash_item(digest, key)
            _hash_item(digest, value)
    elif isinstance(item, (list, tuple)):
        fields = getattr(item, "_fields", None)  # a NamedTuple: its field names are part of its meaning
        digest.update(f"L{type(item).__qualname__}{fields or ''}:{len(item)}:".encode())
        for value in item:
            _hash_item(digest, value)
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        _hash_item(digest, {f.name: getattr(item, f.name) for f in dataclasses.fields(item)})
        digest.update(type(item).__qualname__.encode())
    elif hasattr(item, "__dict__"):
        _hash_item(digest, vars(item))
        digest.update(type(item).__qualname__.encode())
    else:
        _hash_item(digest, repr(item))


def model_fingerprint(model: nn.Module) -> ModelFingerprint:
    """The model's class and every parameter's name and shape (what a checkpoint must fit)."""
    return ModelFingerprint(class_name=type(model).__name__,
                            shapes={name: tuple(p.shape) for name, p in model.named_parameters()})


@dataclass(frozen=True, kw_only=True)
class RunIdentity:
    """What defines a run: a resume that differs in any of these is refused (``compare_runs`` names each
    difference), since the continued run would not be the run that was started. A checkpoint holds it as JSON
    (``to_dict``: its "run")."""

    seed: int
    global_batch_size: int  # examples per optimizer step, all ranks
    world_size: int
    seq_len: int  # tokens per example
    data: DataFingerprint
    model: ModelFingerprint
    precision: str  # resolved: "fp32", "bf16-mixed" or "fp16-mixed"
    # The peak learning rate and warm-up as resolved at the start; None in the identity a resume checks: chosen
    # automatically, they are the run's own (the resume takes the run's) and not compared.
    lr: float | None = None
    warmup_steps: int | None = None
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float | None  # None: not clipped
    fsdp: bool
    lr_schedule: str
    adam_betas: tuple[float, float]
    adam_eps: float
    offload_optimizer: bool  # the optimizer's state lives in host RAM
    optimizer: str  # the optimizer in words (PlanSettings.optimizer_text): its state's layout

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (a checkpoint's "run"), keys in field order, ``adam_betas`` a list."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "data": self.data.to_dict(), "model": self.model.to_dict(), "adam_betas": list(self.adam_betas)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunIdentity:
        """The identity ``to_dict`` wrote (``lr`` and ``warmup_steps`` may be left out: automatic); "data" and
        "model" may already be fingerprints.

        Raises:
            KeyError, TypeError: a mapping that is not one (a missing or unknown field).
        """
        fingerprints = {"data": DataFingerprint, "model": ModelFingerprint}
        typed = {name: value if name not in fingerprints or isinstance(value, fingerprints[name])
                 else fingerprints[name].from_dict(value) for name, value in values.items()}
        return cls(**{**typed, "adam_betas": tuple(values["adam_betas"])})


# How a resume treats a changed TrainConfig field. "refuse": the continued run would not be the run that was
# started (other examples, another optimisation, another optimizer-state layout); "apply": it changes when or how,
# not what, is computed (or extends the schedule), and is applied with a logged line.
RESUME_POLICY: dict[str, str] = {
    **dict.fromkeys(("seed", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip", "precision",
                     "offload_optimizer"), "refuse"),
    **dict.fromkeys(("max_steps", "save_every", "eval_every", "eval_batches", "progress", "sample_bytes",
                     "micro_batch_size", "checkpointing", "offload_activations", "chunked_loss", "tiled_mlp",
                     "compile", "fsdp"), "apply"),
}
# The identity's fields a resume may change: a checkpoint's state loads onto any number of ranks (a whole one on
# every rank; FSDP2's shards resharded as they are read, memtrain.run.shards), and a step's examples are the same
# whatever the ranks (StepBatches: the global batch, compared, is cut into the ranks' shares).
RESHARDED = ("world_size", "fsdp")


def compare_runs(saved: RunIdentity, now: RunIdentity) -> list[str]:
    """One message per run-defining difference between a checkpoint's run and this one (empty: the same run)."""
    problems = []
    fix = f"To resolve this error, resume with the original {{what}}, or start a new run in another {arg('out_dir')}."
    saved_values, now_values = saved.to_dict(), now.to_dict()  # the values as the messages show them
    for key in (f.name for f in dataclasses.fields(RunIdentity)):
        if getattr(saved, key) == getattr(now, key) or (key in ("lr", "warmup_steps") and getattr(now, key) is None) \
                or key in RESHARDED:
            continue
        if key == "data":
            problems.append(Message(_data_difference(saved.data, now.data) + " " + fix.format(what="data")))
        elif key == "model":
            problems.append(Message(_model_difference(saved.model, now.model) + " " + fix.format(what="model")))
        else:
            was, new = saved_values[key], now_values[key]
            problems.append(Message(f"resume: {arg(key, new)} now but {arg(key, was)} in the run being resumed. "
                                    f"To resolve this error, pass {arg(key, was)} (or leave it out: `memtrain train "
                                    f"--resume` reads the run's config), or start a new run in another "
                                    f"{arg('out_dir')}."))
    return problems


def _data_difference(saved: DataFingerprint, now: DataFingerprint) -> str:
    if saved.examples != now.examples:
        return (f"resume: the training data differ from the run being resumed: {now.examples} examples now, "
                f"{saved.examples} then (another file, or the same file changed).")
    return (f"resume: the training data differ from the run being resumed: the same {now.examples} examples, "
            f"but other contents (SHA-256 of the {now.of} {now.sha256[:12]} now, {saved.sha256[:12]} then): the "
            "file changed, or another file of the same size.")


def _model_difference(saved: ModelFingerprint, now: ModelFingerprint) -> str:
    if saved.class_name != now.class_name:
        return (f"resume: the model is a {now.class_name} now but was a {saved.class_name} in the run being "
                "resumed.")
    old, new = saved.shapes, now.shapes
    parts = []
    for label, names in (("only in this model", [n for n in new if n not in old]),
                         ("only in the run being resumed", [n for n in old if n not in new])):
        if names:
            parts.append(f"{len(names)} parameter(s) {label} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    reshaped = [n for n in new if n in old and new[n] != old[n]]
    if reshaped:
        parts.append(f"{len(reshaped)} of another shape ("
                     + ", ".join(f"{n}: {list(new[n])} now, {list(old[n])} then" for n in reshaped[:3])
                     + (", ..." if len(reshaped) > 3 else "") + ")")
    return f"resume: the model differs from the run being resumed: {'; '.join(parts) or 'its parameters differ'}."


def _schedule_note(now: Mapping[str, Any]) -> str:
    """What a new max_steps does to the run's learning-rate schedule (cosine, linear or constant)."""
    schedule = now.get("lr_schedule") or "cosine"
    if schedule == "constant":
        return " (the learning rate stays constant after the warm-up)"
    return f" (the {schedule} schedule now ends there)"


def applied_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One log line per changed setting a resume applies (RESUME_POLICY "apply")."""
    lines = []
    for key, policy in RESUME_POLICY.items():
        if policy == "apply" and key in saved and key in now and saved[key] != now[key]:
            note = _schedule_note(now) if key == "max_steps" else ""
            lines.append(f"resume: {key}={now[key]!r} applied (the run had {key}={saved[key]!r}){note}")
    return lines


