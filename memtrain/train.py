"""train(): one readable training loop built from memtrain's public pieces.

Read it top to bottom: set-up, then one optimizer step per loop iteration, then the run folder. Every memory
technique enters as one visible line; every automatic choice is printed with its reason.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from memtrain.checkpointing import apply_checkpointing
from memtrain.errors import ConfigError
from memtrain.measure import MemoryMeter, optimizer_state_bytes
from memtrain.report import format_bytes

CheckpointingMode = Literal["none", "all", "every", "auto"]

# Files whose presence marks a folder as holding a run's results.
RUN_FILES = ("metrics.jsonl", "model.safetensors")


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs besides the model and the data. Memory effects are noted per field."""

    max_steps: int = 500
    micro_batch_size: int = 16  # smaller reduces activation memory proportionally
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the cosine schedule decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    checkpointing: CheckpointingMode = "auto"  # "all" cuts saved activations to the blocks' inputs
    checkpoint_every: int = 2  # with checkpointing="every": one block in this many
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    out_dir: str | None = None  # run folder; None writes nothing
    overwrite: bool = False  # True lets a run replace another run's results in out_dir
    progress: bool = True

    def validate(self) -> None:
        """Raises one ConfigError listing every bad field."""
        problems = []
        for name in ("max_steps", "micro_batch_size", "checkpoint_every", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1.")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            problems.append(f"lr={self.lr!r} must be a positive number, e.g. 3e-3.")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps={self.warmup_steps} must be >= 0.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")
        if self.grad_clip is not None and not self.grad_clip > 0:
            problems.append(f"grad_clip={self.grad_clip} must be > 0, or None for no clipping.")
        if self.checkpointing not in ("none", "all", "every", "auto"):
            problems.append(f"checkpointing={self.checkpointing!r} is not one of none, all, every, auto.")
        ConfigError.raise_if(problems)


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    final_loss: float
    eval_loss: float | None
    checkpointed_blocks: tuple[str, ...]
    activation_bytes: int  # saved for backward in one micro-batch, as measured
    model_state_bytes: int
    out_dir: str | None
    reasons: tuple[str, ...] = field(default_factory=tuple)


# -- files --------------------------------------------------------------------------------------------------
def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a crash leaves either the old file or the new one, never half of it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_model(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_model

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_model(model, tmp)  # keeps one copy of tied weights
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prepare_run_folder(out_dir: str | os.PathLike[str], *, overwrite: bool) -> Path:
    """Creates ``out_dir``, refusing one that holds another run's results unless ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file. To resolve this error, pass a folder path.")
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"--out {str(out)!r} already holds a run's results ({', '.join(existing)}). To resolve this error, "
            "pass another --out folder, or --overwrite to replace them."
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


# -- pieces of the loop -------------------------------------------------------------------------------------
def choose_checkpointing(model: nn.Module, config: TrainConfig) -> tuple[list[str], str]:
    """Applies the configured checkpointing; returns the wrapped blocks and the reason, for the log."""
    if config.checkpointing == "none":
        return [], "checkpointing off (--checkpointing none): every activation is kept"
    if config.checkpointing == "every":
        names = apply_checkpointing(model, every=config.checkpoint_every)
        return names, f"checkpointing {len(names)} blocks, one in {config.checkpoint_every} (--checkpointing every)"
    names = apply_checkpointing(model)
    if config.checkpointing == "auto":
        return names, (f"checkpointing all {len(names)} blocks, because: auto with no memory budget picks the "
                       "smallest activation memory (about one extra forward of time)")
    return names, f"checkpointing all {len(names)} blocks (--checkpointing all)"


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def language_model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy on fp32 logits; works for memtrain's GPT and Hugging Face models."""
    out = model(x)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)


def _batches(dataset: Dataset, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)
    if len(loader) == 0:
        raise ConfigError(f"the training data holds {len(dataset)} examples, fewer than one micro-batch of "
                          f"{batch_size}. To resolve this error, lower --micro-batch-size or use more data.")
    while True:  # epochs
        yield from loader


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, config: TrainConfig, device: torch.device) -> float:
    was_training = model.training
    model.eval()
    loader = DataLoader(dataset, batch_size=config.micro_batch_size)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == config.eval_batches:
            break
        losses.append(language_model_loss(model, x.to(device), y.to(device)).item())
    model.train(was_training)
    return sum(losses) / max(1, len(losses))


# -- the loop -----------------------------------------------------------------------------------------------
def train(model: nn.Module, data: Dataset | tuple[Dataset, Dataset], config: TrainConfig) -> TrainResult:
    """Trains ``model`` on ``data`` (a dataset of (x, y) token pairs, or a (train, validation) pair).

    Args:
        model: a language model returning logits (memtrain's GPT, a Hugging Face causal LM).
        data: training examples ``(x, y)``, or ``(train, validation)``.
        config: the run's settings.

    Returns:
        A ``TrainResult``; with ``config.out_dir`` the run folder holds ``metrics.jsonl`` (one line per optimizer
        step) and ``model.safetensors``.

    Raises:
        ConfigError: a bad config, or an ``out_dir`` holding another run's results (without ``overwrite``).
    """
    config.validate()
    train_data, val_data = data if isinstance(data, tuple) else (data, None)
    out = prepare_run_folder(config.out_dir, overwrite=config.overwrite) if config.out_dir else None
    torch.manual_seed(config.seed)
    device = next(model.parameters()).device
    model.train()

    blocks, reason = choose_checkpointing(model, config)
    reasons = [reason]
    for line in reasons:  # every automatic choice is shown with its reason, before the first step
        tqdm.write(f"  {line}", file=sys.stderr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    batches = _batches(train_data, config.micro_batch_size, config.seed)
    metrics: list[dict[str, Any]] = []
    bar = tqdm(total=config.max_steps, disable=not config.progress, unit="step", dynamic_ncols=True)
    tokens = 0
    eval_loss = None
    start = time.perf_counter()
    for step in range(config.max_steps):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        x, y = (t.to(device, non_blocking=True) for t in next(batches))

        # The meter counts the bytes autograd saves in this step's forward: the figure checkpointing cuts.
        with MemoryMeter(model, optimizer) as meter:
            loss = language_model_loss(model, x, y)
            meter.mark("forward")
            loss.backward()
            meter.mark("backward")
        grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip).item()
                     if config.grad_clip is not None else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward

        report = meter.report()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens += y.numel()
        line = {
            "step": step + 1,
            "loss": loss.item(),
            "lr": optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
            "tokens_per_s": y.numel() / seconds,
            "activation_bytes": report.activation_bytes,
            "model_state_bytes": report.parameter_bytes + report.gradient_bytes + optimizer_state_bytes(optimizer),
            "peak_bytes": report.peak_bytes,
        }
        if val_data is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.max_steps):
            eval_loss = line["eval_loss"] = evaluate(model, val_data, config, device)
        metrics.append(line)
        if out is not None:
            atomic_write_bytes(out / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics).encode())
        memory = (f"peak {format_bytes(report.peak_bytes)}" if report.peak_bytes is not None
                  else f"saved {format_bytes(report.activation_bytes)}")
        bar.set_postfix_str(f"loss {line['loss']:.3f} | {line['tokens_per_s']:.0f} tok/s | {memory}")
        bar.update()
    bar.close()

    if out is not None:
        _save_model(model, out / "model.safetensors")
        atomic_write_bytes(out / "config.json", json.dumps(asdict(config), indent=2).encode())
    last = metrics[-1]
    return TrainResult(
        steps=config.max_steps,
        tokens=tokens,
        seconds=time.perf_counter() - start,
        final_loss=last["loss"],
        eval_loss=eval_loss,
        checkpointed_blocks=tuple(blocks),
        activation_bytes=last["activation_bytes"],
        model_state_bytes=last["model_state_bytes"],
        out_dir=str(out) if out is not None else None,
        reasons=tuple(reasons),
    )
