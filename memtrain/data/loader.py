"""The loader: ``DataLoader`` settings (workers, pinning, prefetch) checked against the machine, each automatic
choice with its reason, and ``make_loader``, which builds the loader from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler

from memtrain.errors import ConfigError
from memtrain.message import Message, arg

Auto = Literal["auto"]
MAX_AUTO_WORKERS = 8  # beyond this, workers mostly add memory (a copy of the process each) and start-up time


@dataclass(frozen=True)
class Machine:
    """What the loader's automatic choices depend on. ``Machine.detect()`` reads it; tests pass their own."""

    cpus: int  # CPUs this process may run on (its affinity mask, not the machine's total)
    accelerator: str | None  # "cuda", "xpu", "mps", ... or None
    local_world_size: int = 1  # training processes sharing these CPUs (torchrun's LOCAL_WORLD_SIZE)

    @classmethod
    def detect(cls) -> Machine:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS and Windows have no affinity mask
            cpus = os.cpu_count() or 1
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")
        if not local.isdigit() or int(local) < 1:
            raise ConfigError(f"LOCAL_WORLD_SIZE={local!r} is not a positive integer. To resolve this error, launch "
                              "with torchrun (which sets it) or unset it.")
        return cls(cpus, accelerator.type if accelerator is not None else None, int(local))


@dataclass(frozen=True)
class LoaderSettings:
    """The resolved DataLoader settings, why each was chosen, and hints about valid but poor choices."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None  # batches each worker keeps ready; None without workers
    persistent_workers: bool
    reasons: tuple[str, ...]
    hints: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line per choice and hint, for a start-up log (returned, not printed)."""
        return "\n".join([*self.reasons, *(f"Hint: {h}" for h in self.hints)])

    def dataloader_kwargs(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                "prefetch_factor": self.prefetch_factor, "persistent_workers": self.persistent_workers}


def parse_device(device: torch.device | str, problems: list[str]) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        problems.append(Message(f"{arg('device', device)} is not a torch device. To resolve this error, pass e.g. "
                                "'cuda', 'cuda:0' or 'cpu'."))
        return torch.device("cpu")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class _Notes:
    """What resolving the settings finds: problems (raised together at the end), reasons and hints."""

    problems: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)


def _resolve_workers(num_workers: int | Auto, machine: Machine, notes: _Notes) -> int:
    """num_workers: "auto" is one worker per CPU of this process but one, kept for the training loop."""
    per_process = max(1, machine.cpus // machine.local_world_size)
    auto_workers = min(MAX_AUTO_WORKERS, per_process - 1)
    share = (f"{machine.cpus} usable CPUs / {machine.local_world_size} local processes = {per_process} each"
             if machine.local_world_size > 1 else f"{machine.cpus} usable CPUs")
    if num_workers == "auto":
        workers = auto_workers
        notes.reasons.append(f"num_workers={workers}, because: {share}" + (
            "; a worker would compete with the training loop for the only CPU" if workers == 0 else
            ", one kept for the training loop" + (f", capped at {MAX_AUTO_WORKERS}"
                                                   if per_process - 1 > MAX_AUTO_WORKERS else "")))
    elif not _is_int(num_workers) or num_workers < 0:
        notes.problems.append(f"num_workers={num_workers!r} must be 'auto' or an integer >= 0. To resolve this "
                              f"error, pass num_workers='auto' ({auto_workers} here) or a count such as 0 or 2.")
        workers = 0
    else:
        workers = num_workers
        notes.reasons.append(f"num_workers={workers} (as given)")
        if workers > per_process:
            notes.hints.append(f"num_workers={workers} exceeds the {share}: extra workers only take turns and each "
                               f"holds a copy of the process. Try num_workers='auto' ({auto_workers}).")
    return workers


def _resolve_prefetch_factor(prefetch_factor: int | Auto, workers: int, explicit_zero: bool,
                             notes: _Notes) -> int | None:
    """prefetch_factor: it needs workers; with none, an explicit num_workers=0 makes it an error, "auto" a hint."""
    if prefetch_factor == "auto":
        prefetch = 2 if workers else None
        if workers:
            notes.reasons.append("prefetch_factor=2, because: each worker keeps two batches ready (torch's default)")
    elif not _is_int(prefetch_factor) or prefetch_factor < 1:
        notes.problems.append(f"prefetch_factor={prefetch_factor!r} must be 'auto' or an integer >= 1. To resolve "
                              "this error, pass prefetch_factor='auto' (2 with workers).")
        prefetch = None
    elif workers == 0 and explicit_zero:
        notes.problems.append(f"prefetch_factor={prefetch_factor} needs worker processes, but num_workers=0 loads in "
                              "the training process. To resolve this error, pass num_workers >= 1, or drop "
                              "prefetch_factor.")
        prefetch = None
    elif workers == 0:
        notes.hints.append(f"prefetch_factor={prefetch_factor} does not apply: num_workers='auto' chose 0 workers.")
        prefetch = None
    else:
        prefetch = prefetch_factor
        notes.reasons.append(f"prefetch_factor={prefetch} (as given)")
    return prefetch


def _resolve_persistent_workers(persistent_workers: bool | Auto, workers: int, explicit_zero: bool,
                                notes: _Notes) -> bool:
    """persistent_workers: it needs workers; with none, an explicit num_workers=0 makes it an error, "auto" a
    hint."""
    if persistent_workers == "auto":
        persistent = workers > 0
        if persistent:
            notes.reasons.append("persistent_workers=True, because: workers then survive the epoch instead of "
                                 "restarting (and re-copying the dataset)")
    elif not isinstance(persistent_workers, bool):
        notes.problems.append(f"persistent_workers={persistent_workers!r} must be 'auto', True or False. To resolve "
                              "this error, pass persistent_workers='auto'.")
        persistent = False
    elif persistent_workers and workers == 0 and explicit_zero:
        notes.problems.append("persistent_workers=True needs worker processes, but num_workers=0 loads in the "
                              "training process. To resolve this error, pass num_workers >= 1, or "
                              "persistent_workers=False.")
        persistent = False
    elif persistent_workers and workers == 0:
        notes.hints.append("persistent_workers=True does not apply: num_workers='auto' chose 0 workers.")
        persistent = False
    else:
        persistent = persistent_workers
    return persistent


def _resolve_pin_memory(pin_memory: bool | Auto, device: torch.device | str | None, machine: Machine,
                        notes: _Notes) -> bool:
    """pin_memory: it only helps a host -> accelerator copy."""
    target = parse_device(device, notes.problems) if device is not None else None
    if target is not None and target.type not in ("cpu", "meta") and target.type != machine.accelerator:
        notes.problems.append(f"{arg('device', str(target))}, but this machine's accelerator is "
                              f"{machine.accelerator}. To resolve this error, pass a device that exists here, e.g. "
                              "'cpu'.")
    to_accelerator = machine.accelerator is not None and (target is None or target.type == machine.accelerator)
    where = (f"batches go to {target}" if target is not None else
             f"a {machine.accelerator} accelerator is present" if machine.accelerator else "no accelerator is present")
    if pin_memory == "auto":
        pin = to_accelerator
        notes.reasons.append(f"pin_memory={pin}, because: {where}" + (
            " (pinned memory makes the host->device copy asynchronous)" if pin else
            " (pinning would only add a copy per batch)"))
    elif not isinstance(pin_memory, bool):
        notes.problems.append(f"pin_memory={pin_memory!r} must be 'auto', True or False. To resolve this error, pass "
                              "pin_memory='auto'.")
        pin = False
    elif pin_memory and not to_accelerator:
        notes.problems.append(f"pin_memory=True, but {where}: pinned memory only speeds host->accelerator copies, and "
                              "pinning costs a copy per batch. To resolve this error, pass pin_memory='auto' (pins "
                              "exactly when batches go to an accelerator) or pin_memory=False.")
        pin = False
    else:
        pin = pin_memory
        notes.reasons.append(f"pin_memory={pin} (as given)")
        if not pin and to_accelerator:
            notes.hints.append("pin_memory=False with an accelerator: each host->device copy blocks the CPU, so "
                               "DevicePrefetcher cannot overlap it with compute. Try pin_memory='auto'.")
    return pin


def resolve_loader_settings(*, num_workers: int | Auto = "auto", pin_memory: bool | Auto = "auto",
                            prefetch_factor: int | Auto = "auto", persistent_workers: bool | Auto = "auto",
                            device: torch.device | str | None = None, machine: Machine | None = None) -> LoaderSettings:
    """Resolves the "auto" settings for this machine and checks the explicit ones. Pure given ``machine``.

    Choices:
        num_workers "auto": one worker per CPU of this process (per training process under torchrun) but one,
            kept for the training loop, at most 8; 0 with one CPU.
        pin_memory "auto": True exactly when batches go to an accelerator (``device``, or the machine's
            accelerator when ``device`` is None): pinned memory makes the copy asynchronous; on CPU it is only
            an extra copy.
        prefetch_factor "auto": 2 (torch's default) with workers, None without.
        persistent_workers "auto": True with workers (no worker restart, dataset re-copy, each epoch).

    Raises:
        ConfigError: every contradictory or invalid explicit setting, at once: ``persistent_workers=True`` or a
            ``prefetch_factor`` with ``num_workers=0``, ``pin_memory=True`` when batches stay on the CPU or no
            accelerator exists, negative or non-integer counts. An explicit ``persistent_workers``/
            ``prefetch_factor`` that cannot apply because "auto" chose 0 workers (a 1-CPU machine) is not an
            error, so a script stays portable; it is reported in ``hints``.
    """
    machine = machine or Machine.detect()
    notes = _Notes()
    workers = _resolve_workers(num_workers, machine, notes)
    explicit_zero = num_workers == 0
    prefetch = _resolve_prefetch_factor(prefetch_factor, workers, explicit_zero, notes)
    persistent = _resolve_persistent_workers(persistent_workers, workers, explicit_zero, notes)
    pin = _resolve_pin_memory(pin_memory, device, machine, notes)
    ConfigError.raise_if(notes.problems)
    return LoaderSettings(workers, pin, prefetch, persistent, tuple(notes.reasons), tuple(notes.hints))


def make_loader(dataset: Dataset, *, batch_size: int | None = None, num_workers: int | Auto = "auto",
                pin_memory: bool | Auto = "auto", prefetch_factor: int | Auto = "auto",
                persistent_workers: bool | Auto = "auto", shuffle: bool = False, drop_last: bool = False,
                sampler: Sampler | None = None, batch_sampler: Sampler[list[int]] | None = None,
                collate_fn: Callable[[list[Any]], Any] | None = None, seed: int | None = None,
                device: torch.device | str | None = None, machine: Machine | None = None) -> DataLoader:
    """A ``torch.utils.data.DataLoader`` whose worker, pinning and prefetch settings suit this machine.

    Workers overlap loading with training at the cost of one process (and its memory) each; pinned memory makes
    the host->device copy asynchronous at the cost of page-locked host memory. The settings, with the reason for
    each automatic choice, are on ``loader.memtrain_settings`` (a ``LoaderSettings``; print its ``summary()``).
    See ``resolve_loader_settings`` for the choices and the errors.

    Args:
        dataset: a map-style or iterable dataset.
        batch_size: examples per batch; leave None when passing ``batch_sampler``.
        num_workers, pin_memory, prefetch_factor, persistent_workers: "auto" or an explicit value.
        shuffle, drop_last, sampler, batch_sampler, collate_fn: as for ``DataLoader``.
        seed: seeds the shuffle and the workers' base seed, so a run repeats exactly; the shuffle order depends
            on the seed only, not on the worker settings (so not on the machine).
        device: where the batches go (decides pinning); None means the machine's accelerator, if any.
        machine: the CPUs and accelerator to plan for (default ``Machine.detect()``).

    Raises:
        ConfigError: every bad or contradictory setting, at once, each with its fix.

    Example:
        >>> loader = make_loader(list(range(10)), batch_size=4, num_workers=0, machine=Machine(2, None))
        >>> [b.tolist() for b in loader], loader.memtrain_settings.pin_memory
        ([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], False)
    """
    problems: list[str] = []
    iterable = isinstance(dataset, IterableDataset)
    if batch_sampler is not None:
        given = [name for name, value in (("batch_size", batch_size), ("shuffle", shuffle),
                                          ("drop_last", drop_last), ("sampler", sampler)) if value]
        if given:
            problems.append(f"batch_sampler decides the batches, so {', '.join(given)} cannot apply. To resolve "
                            "this error, drop them (set them on the batch sampler instead).")
    elif batch_size is None:
        problems.append("no batch_size. To resolve this error, pass batch_size=N or a batch_sampler.")
    elif not _is_int(batch_size) or batch_size < 1:
        problems.append(f"batch_size={batch_size!r} must be an integer >= 1. To resolve this error, pass e.g. "
                            "batch_size=8.")
    elif hasattr(dataset, "__len__") and sampler is None and drop_last and len(dataset) < batch_size:
        problems.append(f"the dataset holds {len(dataset)} examples, fewer than one batch of {batch_size} with "
                        "drop_last=True. To resolve this error, lower batch_size or pass drop_last=False.")
    if sampler is not None and shuffle:
        problems.append("shuffle=True with a sampler: the sampler decides the order. To resolve this error, pass "
                        "shuffle=False (shuffle in the sampler).")
    if iterable and (shuffle or sampler is not None or batch_sampler is not None):
        problems.append("an IterableDataset decides its own order, so shuffle, sampler and batch_sampler cannot "
                        "apply. To resolve this error, drop them, or use a map-style Dataset.")
    if seed is not None and (not _is_int(seed) or seed < 0):
        problems.append(f"{arg('seed', seed)} must be an integer >= 0, or None. To resolve this error, pass e.g. "
                        f"{arg('seed', 0)}.")
    try:
        settings = resolve_loader_settings(num_workers=num_workers, pin_memory=pin_memory,
                                           prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                                           device=device, machine=machine)
    except ConfigError as e:
        problems += e.problems
    ConfigError.raise_if(problems)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if shuffle and seed is not None:
        # NOTE: a shuffle drawing from the DataLoader's generator would also share it with the workers' base
        # seed, drawn once per new iterator: the order of epoch 2 on would then depend on num_workers and
        # persistent_workers (and so on the machine, through "auto"). Its own generator keeps one order per seed.
        sampler, shuffle = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)), False
    loader = DataLoader(dataset, batch_size=batch_size if batch_sampler is None else 1, shuffle=shuffle,
                        sampler=sampler, batch_sampler=batch_sampler, drop_last=drop_last, collate_fn=collate_fn,
                        generator=generator, **settings.dataloader_kwargs())
    loader.memtrain_settings = settings
    return loader
