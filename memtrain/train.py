"""train(): plan -> apply -> loop, built from memtrain's public pieces.

Read it top to bottom: the plan (``memtrain.runplan.plan_run``: the config's fixed choices kept, the rest chosen
by ``memtrain.planner`` to fit the budget, each with its reason), ``apply_plan``, then one optimizer step per
iteration of the loop (checked against the plan at step 2, re-planned when the device disagrees), then the run
folder.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import Dataset, Sampler, Subset
from tqdm import tqdm

from memtrain.accumulation import GradientAccumulator, accumulation_steps
from memtrain.checkpointing import Checkpointing, compile_model
from memtrain.data import DevicePrefetcher, make_loader, map_tensors
from memtrain.errors import ConfigError, MemtrainError
from memtrain.files import atomic_write_bytes
from memtrain.hf import is_hf_model
from memtrain.loss import chunked_loss_kind
from memtrain.measure import MemoryMeter, optimizer_state_bytes
from memtrain.planner import PlanSettings, apply_plan, budget_bytes, configure_model
from memtrain.precision import MixedPrecision, resolve_precision
from memtrain.report import format_bytes
from memtrain.runplan import (
    RunPlan,
    check_plan,
    plan_request,
    plan_run,
    replan,
    shortfall_after_oom,
    write_run_report,
)
from memtrain.runstate import (
    MetricsLog,
    RunCheckpoints,
    RunFolder,
    StopSignals,
    agree_on_stop,
    applied_changes,
    data_fingerprint,
    model_fingerprint,
    model_state_dict,
    read_run_config,
    restore_run_state,
    resume_run,
    save_run_state,
    save_weights_file,
    tied_duplicates,
    write_faults,
)

PrecisionChoice = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"]
MAX_SEED = 2**63  # seeds are torch.Generator seeds (64 bits), plus one per epoch of the data
DEFAULT_MICRO_BATCH = 16  # the global batch per rank when neither micro_batch_size nor global_batch_size is given
MAX_REPLANS_PER_STEP = 4  # out of memory again after this many re-plans of one step: an error, not a loop


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs besides the model and the data. Memory effects are noted per field."""

    max_steps: int = 500
    # The memory budget: the plan (memtrain.planner) picks every choice left as None / "auto" below so that the
    # predicted peak fits it at the highest predicted tokens/s, and the run checks the plan at step 2.
    budget: int | str | None = None  # device bytes per rank ("24GiB"); None: what the device has free at the start
    host_budget: int | str | None = None  # host RAM the plan may use (offloads, pinned buffers); None: what is free
    safety_margin: float = 0.05  # of the budget, left for the allocator's fragmentation
    micro_batch_size: int | None = None  # examples per forward (activations grow with it); None: the plan's
    global_batch_size: int | None = None  # examples per optimizer step, all ranks; None = 16 x world size, or
    # micro_batch_size x world size where that is given
    lr: float = 3e-3
    warmup_steps: int | None = None  # linear warm-up; None: min(50, max_steps // 10), so short runs reach lr
    min_lr_ratio: float = 0.1  # the cosine schedule decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0  # the global gradient norm is clipped to this; None: not clipped
    precision: PrecisionChoice = "auto"  # 16-bit halves most activation bytes
    # "auto": the plan's per-block keep / recompute / offload; else a Checkpointing or a spelling it parses
    # ("none", "all" (only the blocks' inputs saved), "every:K", "selective", "blocks(RKO...)", "...+offload").
    checkpointing: str | Checkpointing = "auto"
    checkpoint_every: int = 2  # with checkpointing="every" (the older spelling of "every:K"): K
    # None below: the plan decides; True / False: fixed, and the plan fits the rest around it.
    offload_activations: bool | None = None  # saved activations in pinned host memory (CUDA only)
    offload_optimizer: bool | None = None  # fp32 master + AdamW state in host RAM (12 bytes/param off the device)
    chunked_loss: bool | None = None  # the loss's fp32 logits 1024 tokens at a time, never the whole batch's
    state_precision: str | None = None  # AdamW's moments: "fp32" (8 bytes/param), "bf16" (4), "int8" (about 2)
    step_in_backward: bool | None = None  # each parameter steps as its gradient is final (no gradient buffers)
    offload_fraction: float | None = None  # this share of AdamW's state in host RAM (the rest stays on the device)
    compile: bool = False  # torch.compile the training forward/backward (fused kernels; the first steps compile)
    fsdp: bool = False  # under torchrun: True shards parameters, gradients and optimizer state over ranks
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int | None = 100  # optimizer steps between run checkpoints (also at the end and on signals)
    out_dir: str | None = None  # run folder; None writes nothing
    overwrite: bool = False  # True lets a run replace another run's results in out_dir
    resume: bool = False  # True continues from the newest intact checkpoint in out_dir
    sample_bytes: int = 240  # length of the text sample written at the end (0: none)
    merge_lora: bool = False  # a LoRA model's hf/ folder holds the merged weights instead of the adapters
    progress: bool = True

    def validate(self) -> None:
        """Raises one ConfigError listing every bad field (each named as the argument, e.g. ``out_dir=``)."""
        problems = []
        for name in ("max_steps", "checkpoint_every", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1. To resolve this error, pass e.g. {name}=1.")
        for name in ("micro_batch_size", "global_batch_size", "save_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"{name}={value!r} must be an integer >= 1, or unset. To resolve this error, pass e.g. {name}=4, or "
                                "leave it unset.")
        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not (number(self.lr) and self.lr > 0):
            problems.append(f"lr={self.lr!r} must be a positive number. To resolve this error, pass e.g. lr=3e-3.")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool) or
                                              not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            problems.append(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0, or None for "
                            "min(50, max_steps // 10). To resolve this error, pass e.g. warmup_steps=10, or leave it "
                            "unset.")
        elif (isinstance(self.warmup_steps, int) and isinstance(self.max_steps, int)
              and self.warmup_steps > self.max_steps >= 1):
            problems.append(f"warmup_steps={self.warmup_steps} is more than max_steps={self.max_steps}: the learning "
                            f"rate would never reach lr. To resolve this error, pass warmup_steps={self.max_steps // 10}"
                            " or fewer, or leave it unset.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            problems.append(f"seed={self.seed!r} must be an integer in [0, 2**63). To resolve this error, pass e.g. "
                            "seed=0.")
        if not (number(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0):
            problems.append(f"min_lr_ratio={self.min_lr_ratio!r} must be a number in [0, 1]. To resolve this error, pass e.g. "
                            "min_lr_ratio=0.1.")
        if not (number(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"weight_decay={self.weight_decay!r} must be a number >= 0. To resolve this error, pass e.g. "
                            "weight_decay=0.1.")
        if self.grad_clip is not None and not (number(self.grad_clip) and self.grad_clip > 0):
            problems.append(f"grad_clip={self.grad_clip!r} must be a number > 0, or None for no clipping. To resolve this error, "
                            "pass e.g. grad_clip=1.0.")
        for name in ("fsdp", "compile", "overwrite", "resume", "progress", "merge_lora"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be True or False. To resolve this error, pass one of them.")
        for name in ("offload_optimizer", "offload_activations", "chunked_loss", "step_in_backward"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be True, False, or None (the plan decides). "
                                f"To resolve this error, pass one of them.")
        for name in ("budget", "host_budget"):
            try:
                budget_bytes(getattr(self, name), name)
            except ConfigError as e:
                problems += e.problems
        if not (number(self.safety_margin) and 0 <= self.safety_margin < 0.9):
            problems.append(f"safety_margin={self.safety_margin!r} must be a fraction in [0, 0.9). To resolve this error, "
                            "pass e.g. safety_margin=0.05.")
        if self.state_precision not in (None, "fp32", "bf16", "int8"):
            problems.append(f"state_precision={self.state_precision!r} is not one of 'fp32', 'bf16', 'int8', or None "
                            "(the plan decides). To resolve this error, pass one of them.")
        if self.offload_fraction is not None and not (number(self.offload_fraction)
                                                      and 0.0 <= self.offload_fraction <= 1.0):
            problems.append(f"offload_fraction={self.offload_fraction!r} must be a fraction in [0, 1], or None (the "
                            "plan decides). To resolve this error, pass e.g. offload_fraction=0.5.")
        try:
            self.checkpointing_policy()
        except ConfigError as e:
            problems += [p if p.startswith("checkpointing") else f"checkpointing={self.checkpointing!r}: {p}"
                         for p in e.problems]
        if self.micro_batch_size is not None and isinstance(self.global_batch_size, int) \
                and isinstance(self.micro_batch_size, int) and self.micro_batch_size > self.global_batch_size >= 1:
            problems.append(f"micro_batch_size={self.micro_batch_size} is more than global_batch_size="
                            f"{self.global_batch_size}. To resolve this error, pass a micro_batch_size that divides "
                            "it, or leave micro_batch_size unset for the plan to choose.")
        if self.precision not in ("auto", "fp32", "bf16-mixed", "fp16-mixed"):
            problems.append(f"precision={self.precision!r} is not one of auto, fp32, bf16-mixed, fp16-mixed. "
                            "To resolve this error, pass one of them.")
        if self.overwrite is True and self.resume is True:
            problems.append("overwrite=True and resume=True contradict each other. To resolve this error, pass "
                            "resume=True to continue the run in out_dir, or overwrite=True to start it again.")
        if (self.overwrite is True or self.resume is True) and not self.out_dir:
            problems.append("overwrite=True and resume=True need a run folder. To resolve this error, pass "
                            "out_dir='DIR'.")
        if self.merge_lora is True and not self.out_dir:
            problems.append("merge_lora=True writes the merged weights into the run folder's hf/. To resolve this "
                            "error, pass out_dir='DIR'.")
        if self.offload_optimizer is True and self.fsdp is True:
            problems.append("offload_optimizer=True and fsdp=True together: FSDP2 shards the optimizer state itself "
                            "and CPUOffloadOptimizer needs whole parameters. To resolve this error, drop one of "
                            "offload_optimizer=True and fsdp=True.")
        if isinstance(self.sample_bytes, bool) or not isinstance(self.sample_bytes, int) or self.sample_bytes < 0:
            problems.append(f"sample_bytes={self.sample_bytes!r} must be an integer >= 0. To resolve this error, pass "
                            "e.g. sample_bytes=240, or 0 for no sample.")
        if self.checkpointing is None:  # every other None means "the plan decides": here that is "auto"
            problems.append("checkpointing=None is ambiguous. To resolve this error, pass checkpointing='auto' (the "
                            "plan decides) or 'none' (no checkpointing).")
        ConfigError.raise_if(problems)

    def checkpointing_policy(self) -> Checkpointing | None:
        """The fixed checkpointing policy, or None for "auto" (the plan's).

        Raises:
            ConfigError: a value that is not a policy (the message lists the spellings).
        """
        value = self.checkpointing
        if isinstance(value, str) and value.strip().lower() == "auto":
            return None
        if value == "every":
            every = self.checkpoint_every
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ConfigError(f"checkpoint_every={every!r} must be an integer >= 1 (with checkpointing='every').")
            return Checkpointing(mode="every", every=every)
        if isinstance(value, (bool, int)) and not isinstance(value, Checkpointing):
            raise ConfigError(f"checkpointing={value!r} is not a policy. To resolve this error, pass 'auto', 'none', "
                              "'all', 'every:K' (e.g. 'every:2'), 'selective', or a Checkpointing.")
        return Checkpointing.parse(value)


@dataclass(frozen=True)
class TrainResult:
    steps: int  # optimizer steps completed, over the whole run (resumed runs included)
    tokens: int  # tokens trained on in this process's session, all ranks
    seconds: float
    final_loss: float
    eval_loss: float | None
    checkpointed_blocks: tuple[str, ...]
    precision: str
    micro_batch_size: int  # at the end (a re-plan may have changed it)
    accumulation: int  # micro-batches per optimizer step at the end
    activation_bytes: int  # saved for backward in one micro-batch, as measured
    model_state_bytes: int
    peak_bytes: int | None  # CUDA allocator peak over a step
    skipped_steps: int
    resumed_from: int | None
    stopped_by: str | None  # "SIGTERM" / "SIGINT" when a signal ended the run early (received by any rank)
    out_dir: str | None
    reasons: tuple[str, ...] = field(default_factory=tuple)
    # Seconds inside training steps (forward, backward, optimizer) in this session: tokens / step_seconds is the
    # throughput the progress bar shows; ``seconds`` adds evaluation, checkpoints and the run folder's files.
    step_seconds: float = 0.0
    plan: dict[str, Any] | None = None  # the plan at the end: its settings and predictions (RunPlan.to_dict())
    replans: int = 0  # plans made again because the device disagreed (a peak over the budget, out of memory)


def _log(message: str, rank: int = 0) -> None:
    if rank == 0:
        tqdm.write(message, file=sys.stderr)


# -- which examples each step uses ---------------------------------------------------------------------------
class StepBatches(Sampler[list[int]]):
    """Micro-batches of example indices, from optimizer step ``start`` on; depends only on (seed, step).

    Step ``s`` uses examples ``[s*G, (s+1)*G)`` of an endless stream of per-epoch shuffles (G: the global batch);
    rank ``r`` takes its slice, cut into micro-batches. Resuming at step ``s`` or retrying a step with a smaller
    micro-batch therefore sees exactly the examples an uninterrupted run sees.
    """

    def __init__(self, num_examples: int, global_batch: int, micro_batch: int, *, seed: int, start: int = 0,
                 rank: int = 0, world: int = 1):
        self.n, self.global_batch, self.micro_batch = num_examples, global_batch, micro_batch
        self.seed, self.start, self.rank, self.world = seed, start, rank, world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))}
        return self._perms[epoch]

    def step_indices(self, step: int) -> list[int]:
        first = step * self.global_batch
        out = [int(self._perm(i // self.n)[i % self.n]) for i in range(first, first + self.global_batch)]
        share = self.global_batch // self.world
        return out[self.rank * share:(self.rank + 1) * share]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            mine = self.step_indices(step)
            for i in range(0, len(mine), self.micro_batch):
                yield mine[i:i + self.micro_batch]
            step += 1

    def __len__(self) -> int:  # endless; DataLoader only asks for len() when someone calls len(loader)
        return sys.maxsize


# -- pieces of the loop -------------------------------------------------------------------------------------
def warmup_steps_of(config: TrainConfig) -> int:
    """``warmup_steps``, or by default ``min(50, max_steps // 10)``: a 10-step run warms up in 1 step and reaches
    ``lr``, a 500-step run in 50."""
    return config.warmup_steps if config.warmup_steps is not None else min(50, config.max_steps // 10)


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    warmup = warmup_steps_of(config)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, config.max_steps - warmup))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def language_model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                        position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy on fp32 logits (labels of -100 ignored); memtrain GPT or Hugging Face.

    ``y`` is already shifted (``y[t]`` follows ``x[t]``). A model with ``apply_chunked_loss`` computes it from its
    hidden states a chunk of tokens at a time, never holding the whole batch's logits. ``position_ids`` (packed
    rows, ``memtrain.data.PackedRows``) restart at each document, so a Hugging Face model attends within it.
    """
    kind = chunked_loss_kind(model)  # it looks inside DDP's and torch.compile's wrappers
    if kind == "gpt":
        return model(x, y, reduction="sum")
    positions = {} if position_ids is None else {"position_ids": position_ids}
    if kind == "hf" and torch.is_grad_enabled():
        return model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=1, **positions).loss
    out = model(x, **positions)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, config: TrainConfig, device: torch.device,
             precision: MixedPrecision, batch_size: int, examples: int) -> float:
    """Mean loss per token over the first ``examples`` held-out examples (the same ones whatever micro-batch the
    run uses now, e.g. after a re-plan changed it)."""
    was_training = model.training
    model.eval()
    loader = make_loader(Subset(dataset, range(min(len(dataset), examples))), batch_size=batch_size, num_workers=0,
                         device=device)
    total, count = 0.0, 0
    for batch in loader:
        x, y, positions = _unpack(map_tensors(lambda t: t.to(device), batch))
        with precision.autocast():
            total += language_model_loss(model, x, y, positions).item()
        count += int((y != -100).sum())
    model.train(was_training)
    return total / max(1, count)


def _unpack(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, position ids or None) of a batch of windows ``(x, y)`` or packed rows."""
    x, y, *rest = batch
    return x, y, (rest[0] if rest else None)


@torch.no_grad()
def sample_text(model: nn.Module, prompt: str, n: int, seq_len: int, *, seed: int = 0, tokenizer: Any = None) -> str:
    """``n`` tokens sampled after ``prompt`` (top-k 20): bytes decoded as UTF-8 with replacement, or the
    tokenizer's tokens."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = tokenizer.encode(prompt) if tokenizer is not None else list(prompt.encode())
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(n):
        out = model(idx[:, -seq_len:])
        logits = getattr(out, "logits", out)[:, -1, :].float()
        if tokenizer is None:
            logits = logits[:, :256]  # bytes
        kth = torch.topk(logits, min(20, logits.shape[-1])).values[:, [-1]]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    if tokenizer is not None:
        return tokenizer.decode(idx[0].tolist())
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# -- the loop -----------------------------------------------------------------------------------------------
def train(model: nn.Module, data: Dataset | tuple[Dataset, Dataset], config: TrainConfig, *,
          command: Mapping[str, Any] | None = None, tokenizer: Any = None) -> TrainResult:
    """Trains a language model: plan -> apply -> loop.

    The plan (``memtrain.planner``) fits the budget (``config.budget``; unset: what the device has free) at the
    highest predicted tokens/s, keeping every choice the config fixes; ``apply_plan`` sets it up; after step 2 the
    plan is checked against the device (CUDA: the allocator's peak; CPU: the saved bytes), and a peak over the
    budget or an out-of-memory error makes a new plan with the shortfall folded into the estimate, on the same
    global batch and data order.

    Args:
        model: returns logits for token ids (memtrain's GPT, a Hugging Face causal LM, a PEFT LoRA model: only
            the parameters that require grad train), on its training device.
        data: training examples, windows ``(x, y)`` or ``memtrain.data.PackedRows``, or a ``(train,
            validation)`` pair.
        config: the run's settings. Under ``torchrun`` (torch.distributed initialised) the global batch is split
            over the ranks, gradients synchronise once per step (DDP, or FSDP2 with ``fsdp=True``) and only rank
            0 writes files.
        command: the flags of the command that started the run (``memtrain train`` passes its own), kept in the
            run folder's ``config.json`` so that a resume needs no other flag.
        tokenizer: the model's tokenizer, saved into ``hf/`` and used for the text sample.

    Returns:
        A ``TrainResult``. With ``config.out_dir`` the run folder (marked ``.memtrain-run``, locked while the run
        uses it) holds ``config.json`` (written at the start), ``metrics.jsonl`` (one line appended per optimizer
        step), ``model.safetensors``, ``report.json`` (the plan, its prediction and the measurement), ``sample.txt``,
        resumable ``checkpoints/`` and, for a Hugging Face model, ``hf/`` (``from_pretrained`` loads it).

    Raises:
        ConfigError: a bad config, or no plan fits the budget (before anything is written); an ``out_dir``
            holding another run's results or files memtrain did not write (without overwrite/resume), or in use
            by another live run; a resume whose run-defining settings, data or model differ from the run's (each
            difference named).
        RunWriteError: a file of the run could not be written (a full disk, a read-only filesystem); the message
            names it and the last good checkpoint, which is intact.
        MemtrainError: out of memory and no plan fits with the shortfall folded in.
    """
    config.validate()
    if next(iter(model.parameters()), None) is None:
        raise ConfigError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train. To "
                          "resolve this error, pass a model with trainable parameters.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"no parameter of the model ({type(model).__name__}) requires grad: there is nothing to "
                          "train. To resolve this error, unfreeze some (e.g. apply_lora(model, r=8) adds adapters).")
    rank, world = _distributed()
    device = next(model.parameters()).device
    folder = None
    if config.out_dir:
        folder = RunFolder(config.out_dir, overwrite=config.overwrite, resume=config.resume)
        folder.check()  # every rank, before anything is written: all fail alike
    _take_folder(folder, rank, world, device)
    try:
        return _train(model, data, config, folder, command, tokenizer, rank, world, device)
    finally:
        if folder is not None and rank == 0:
            folder.release()  # before the set-up succeeded, this also removes what taking the folder created


def _take_folder(folder: RunFolder | None, rank: int, world: int, device: torch.device) -> None:
    """Rank 0 locks the run folder; under torchrun the other ranks learn whether it could, so that all fail
    alike (a rank failing alone would leave the others waiting in the first collective)."""
    if folder is None:
        return
    error = None
    if rank == 0:
        try:
            folder.lock()
        except ConfigError as e:
            error = e
    if world > 1:
        box = [str(error) if error is not None else None]
        dist.broadcast_object_list(box, src=0, device=device if dist.get_backend() == "nccl" else None)
        if box[0] is not None and error is None:
            raise ConfigError(box[0])
    if error is not None:
        raise error


def _saved_plan(out: Any) -> PlanSettings | None:
    """The plan a run started with (its config.json), whose optimizer a resume keeps; None when unreadable (the
    checkpoint then decides whether the run matches)."""
    try:
        saved = read_run_config(out).get("plan")
        return PlanSettings.from_dict(saved) if isinstance(saved, dict) else None
    except ConfigError:
        return None


def _train(model: nn.Module, data: Dataset | tuple[Dataset, Dataset], config: TrainConfig,
           folder: RunFolder | None, command: Mapping[str, Any] | None, tokenizer: Any, rank: int, world: int,
           device: torch.device) -> TrainResult:
    train_data, val_data = data if isinstance(data, tuple) else (data, None)
    if config.fsdp and world == 1:
        raise ConfigError("fsdp=True needs several processes (torch.distributed with a world size > 1). To "
                          "resolve this error, launch under torchrun --nproc_per_node N, or drop fsdp=True.")
    global_batch = config.global_batch_size or (config.micro_batch_size or DEFAULT_MICRO_BATCH) * world
    if config.micro_batch_size is not None:
        accumulation_steps(config.micro_batch_size, global_batch, world)  # a clear error when it does not divide
    elif global_batch % world:
        raise ConfigError(f"global_batch_size={global_batch} does not split over {world} ranks. To resolve this "
                          f"error, pass a multiple of {world}.")
    if len(train_data) < global_batch:
        raise ConfigError(f"the training data holds {len(train_data)} examples, fewer than one global batch of "
                          f"{global_batch}. To resolve this error, lower global_batch_size or use more data.")
    # Nothing in the folder changes before every check below has passed (taking it is undone if one fails).
    out = folder.path if folder is not None else None
    checkpoints = RunCheckpoints(out) if out is not None else None
    writer = rank == 0 and out is not None
    seq_len = len(train_data[0][0])
    auto_warmup = config.warmup_steps is None
    config = replace(config, warmup_steps=warmup_steps_of(config))  # fixed at the start: lr_at reads this config
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model.train()

    # Plan: every choice the config leaves open, to fit the budget; each with its reason.
    precision_name, precision_reason = resolve_precision(device, config.precision)
    # What defines the run: a resume that differs in any of these is refused, naming each difference.
    run = {"seed": config.seed, "global_batch_size": global_batch, "world_size": world, "seq_len": seq_len,
           "data": data_fingerprint(train_data), "model": model_fingerprint(model), "precision": precision_name,
           "lr": config.lr, "warmup_steps": config.warmup_steps, "min_lr_ratio": config.min_lr_ratio,
           "weight_decay": config.weight_decay, "grad_clip": config.grad_clip, "fsdp": config.fsdp}
    context = {"seq_len": seq_len, "global_batch": global_batch, "device": device, "world": world,
               "precision": precision_name}
    started_with = _saved_plan(out) if config.resume else None  # a resume keeps the run's optimizer
    run_plan = plan_run(model, config, keep_optimizer=started_with, **context)
    s = run_plan.settings
    run["offload_optimizer"] = s.optimizer != "device"
    run["optimizer"] = s.optimizer_text

    # Apply: the model configured in place, the optimizer and accumulator the plan asks for.
    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, config) / config.lr)

    planned = apply_plan(model, s, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay,
                         max_grad_norm=config.grad_clip, scheduler=schedule)
    train_model, optimizer, acc = planned.train_model, planned.optimizer, planned.accumulator
    scheduler, precision, blocks = acc.scheduler, planned.precision, planned.blocks
    micro, accumulation = s.micro_batch_size, s.accumulation
    reasons = [precision_reason, *run_plan.reasons,
               f"global batch {global_batch} = micro-batch {micro} x {accumulation} accumulation x {world} rank(s)",
               f"learning rate {config.lr:g} after {config.warmup_steps} warm-up steps"
               + (" (min(50, max_steps // 10))" if auto_warmup else "") + f", cosine to "
               f"{config.lr * config.min_lr_ratio:g} at step {config.max_steps}"]
    if run_plan.plan is not None:
        p = run_plan.plan
        reasons.insert(1, f"plan: {s.checkpointing} checkpointing, loss {'chunked' if s.chunked_loss else 'whole'}, "
                          f"optimizer {s.optimizer_text}{', compiled' if s.compile else ''}; predicted peak "
                          f"{format_bytes(p.peak_bytes)} per rank, {p.tokens_per_s:,.0f} tokens/s "
                          f"(planned in {p.plan_seconds:.1f} s)")

    def make_accumulator(steps: int) -> GradientAccumulator:
        return GradientAccumulator(train_model, optimizer, steps=steps, scaler=precision.scaler, scheduler=scheduler,
                                   max_grad_norm=config.grad_clip)

    def follow(new: RunPlan) -> None:
        """Switches the model to a re-plan (or a resumed run's plan): the optimizer and its state stay."""
        nonlocal run_plan, blocks, micro, accumulation, acc, train_model
        run_plan = new
        if new.settings.blocks:
            blocks = configure_model(model, new.settings)
            if new.settings.compile:  # blocks that now offload cannot stay in a whole-model graph
                train_model = compile_model(train_model)
        micro, accumulation = new.settings.micro_batch_size, new.settings.accumulation
        acc = _carry_counters(acc, make_accumulator(accumulation))

    notes = list(folder.notes) if writer else []  # what taking the folder found (stale locks, temporaries)
    start_step, resumed_from, plan_check, replans = 0, None, None, []
    check_at: int | None = min(2, config.max_steps)  # the step whose measurement is compared with the plan
    if config.resume:
        def restore(step: int, state: dict[str, Any]) -> None:
            if step >= config.max_steps:
                raise ConfigError(f"resume: the run in {str(out)!r} already reached step {step} of max_steps="
                                  f"{config.max_steps}. To resolve this error, pass a larger max_steps to continue it.")
            restore_run_state(step, state, model, optimizer, scheduler, precision.scaler, acc)

        # An automatic warm-up is the run's own: a longer max_steps on resume must not move it.
        compared = {k: v for k, v in run.items() if not (auto_warmup and k == "warmup_steps")}
        start_step, state, skipped = resume_run(checkpoints, compared, restore)
        if auto_warmup and isinstance(state["run"].get("warmup_steps"), int):
            config = replace(config, warmup_steps=state["run"]["warmup_steps"])
            run["warmup_steps"] = config.warmup_steps
        # The optimizer comes back with the rate the old schedule set for this step; a changed max_steps moves it.
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base * lr_at(scheduler.last_epoch, config) / config.lr
        notes += [f"skipped a damaged checkpoint: {problem}; using the previous one" for problem in skipped]
        notes += applied_changes(state.get("config", {}), asdict(config))
        extra = state["extra"]
        plan_check, replans = extra.get("plan_check"), list(extra.get("replans", []))
        left_at = extra.get("plan_settings")
        if extra.get("plan_request") == plan_request(config) and isinstance(left_at, dict):
            # The memory settings are the run's: continue on the plan it left off with (re-planned ones too).
            left = PlanSettings.from_dict(left_at)
            if left != run_plan.settings:
                try:
                    follow(plan_run(model, config, settings=left, keep_optimizer=left,
                                    correction_bytes=int(extra.get("correction_bytes", 0)), **context))
                except ConfigError as e:
                    notes.append(f"resume: the run's last plan does not fit now ({e}); the new plan applies")
                    plan_check = None  # a plan this session adopts: checked at its second step
        elif isinstance(left_at, dict):
            notes.append("resume: the memory settings changed, so the run continues on a new plan")
            plan_check = None
        # Not checked yet (stopped before it), or on a new plan: the session's second step (its first may still
        # warm the allocator up); a plan checked before is not checked again.
        check_at = min(start_step + 2, config.max_steps) if plan_check is None else None
        resumed_from = start_step
        notes.append(f"resumed from step {start_step} (micro-batch {micro})")

    def loader_from(step: int, micro_batch: int) -> Iterator[Any]:
        sampler = StepBatches(len(train_data), global_batch, micro_batch, seed=config.seed, start=step, rank=rank,
                              world=world)
        # NOTE: no workers: a window is a numpy slice, so loading costs microseconds and a worker adds only IPC.
        loader = make_loader(train_data, batch_sampler=sampler, device=device, num_workers=0)
        loader_settings.append(loader.memtrain_settings.summary())
        return iter(DevicePrefetcher(loader, device))

    loader_settings: list[str] = []
    batches = loader_from(start_step, micro)
    reasons += loader_settings[0].splitlines()
    for line in reasons:
        _log(f"  {line}", rank)
    metrics: list[dict[str, Any]] = []
    metrics_log = MetricsLog(out / "metrics.jsonl") if writer else None
    if writer:  # set-up succeeded: now the folder may change
        with write_faults(out, checkpoints):
            folder.commit()  # the marker; with overwrite, the old run's files go (memtrain's only)
            folder.write_config(asdict(config), command, plan=(started_with or s).to_dict())
            metrics, metric_notes = metrics_log.start(resume_step=start_step if config.resume else None)
        notes += metric_notes
    for line in notes:
        _log(f"  {line}", rank)
    eval_examples = config.eval_batches * (config.micro_batch_size or global_batch // world)
    progress = _Progress(config.max_steps, start_step, enabled=config.progress and rank == 0)
    tokens, step_seconds, eval_loss, last, stopped_by = 0, 0.0, None, None, None
    start = time.perf_counter()
    # Whether an optimizer (any: step-in-backward steps inner ones during backward) began a step in this attempt:
    # after that an out-of-memory error cannot be retried without applying the step twice to some parameters.
    updates = [False]
    watch = register_optimizer_step_pre_hook(lambda *_: updates.__setitem__(0, True))
    try:
        with StopSignals() as signals:
            for step in range(start_step, config.max_steps):
                rng = torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
                lr = optimizer.param_groups[0]["lr"]  # this step's: the scheduler moves it on after the step
                for attempt in range(MAX_REPLANS_PER_STEP + 1):  # after out of memory: again, on a new plan
                    out_of_memory, updates[0] = None, False
                    try:
                        # NOTE: saved-tensor hooks do not stack: while blocks offload, the meter stays out (on
                        # CUDA the allocator peak is the figure then).
                        line = _one_step(train_model, model, optimizer, acc, precision, not _offloads_blocks(model),
                                         batches, accumulation, device, step)
                        break
                    except torch.OutOfMemoryError as e:
                        out_of_memory = str(e)  # the message only: the traceback would pin the step's tensors
                    measured_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
                    if updates[0]:
                        raise MemtrainError(
                            f"out of memory at step {step + 1} after some parameters had already been updated "
                            f"(optimizer {run_plan.settings.optimizer_text}: stepping in backward, or inside the "
                            "optimizer step): a retry would apply this step twice to them; checkpoints already written are "
                            "intact. To resolve this error, resume from the last (resume=True) with a smaller budget= "
                            "or step_in_backward=False.")
                    _release_step(optimizer, device, acc, precision)
                    if attempt == MAX_REPLANS_PER_STEP:
                        raise MemtrainError(f"out of memory at step {step + 1} after {attempt} re-plans (the last: "
                                            f"micro-batch {micro}, checkpointing {run_plan.settings.checkpointing}). "
                                            "To resolve this error, pass a smaller budget= (the plan then leaves "
                                            "more room), offload_optimizer=True, or a shorter seq_len.")
                    new = _after_out_of_memory(run_plan, out_of_memory, model, config, context, step, micro, world,
                                               measured_peak)
                    _log(f"out of memory at step {step + 1} with micro-batch {micro}: " + "; ".join(new.reasons[:2])
                         + f"; now micro-batch {new.settings.micro_batch_size} x {new.settings.accumulation}, "
                         f"checkpointing {new.settings.checkpointing} (global batch unchanged)", rank)
                    replans.append(_replan_record(step, "out of memory", run_plan, new))
                    follow(new)
                    torch.set_rng_state(rng[0])  # the retry draws the same dropout masks
                    if rng[1] is not None:
                        torch.cuda.set_rng_state(rng[1], device)
                    batches = loader_from(step, micro)
                step_tokens, seconds = line.pop("tokens") * world, line.pop("seconds")
                tokens, step_seconds = tokens + step_tokens, step_seconds + seconds
                line["tokens_per_s"] = step_tokens / seconds  # all ranks' tokens in this step's time
                line["lr"] = lr
                if val_data is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.max_steps):
                    eval_loss = line["eval_loss"] = evaluate(model, val_data, config, device, precision, micro,
                                                             eval_examples)
                metrics.append(line)
                last = line
                if step + 1 == check_at and rank == 0:
                    # From the second step on the optimizer state exists: the steady state the plan predicts.
                    plan_check = check_plan(run_plan, line, device)
                    _log(f"  {plan_check['log']}")
                    if plan_check["over_budget"] and world == 1 and step + 1 < config.max_steps:
                        _release_step(optimizer, device, acc, precision)
                        new = replan(run_plan, model, config, why=f"a measured peak over the budget at step {step + 1}",
                                     shortfall_bytes=plan_check["measured_bytes"] - plan_check["predicted_bytes"],
                                     **context)
                        for reason in new.reasons[:2]:
                            _log(f"  {reason}")
                        replans.append(_replan_record(step, "peak over the budget", run_plan, new))
                        follow(new)
                        batches = loader_from(step + 1, micro)
                if metrics_log is not None:
                    with write_faults(metrics_log.path, checkpoints):
                        metrics_log.append(line)
                stopped_by = agree_on_stop(signals.received, device)  # every rank stops after the same step
                due = config.save_every is not None and (step + 1) % config.save_every == 0
                if checkpoints is not None and (due or stopped_by or step + 1 == config.max_steps):
                    if metrics_log is not None:
                        with write_faults(metrics_log.path, checkpoints):
                            metrics_log.sync()  # no checkpoint is ever ahead of the durable metrics
                    extra = {"plan_check": plan_check, "plan_settings": run_plan.settings.to_dict(),
                             "plan_request": plan_request(config), "correction_bytes": run_plan.correction_bytes,
                             "replans": replans}
                    save_run_state(checkpoints if rank == 0 else None, step + 1, micro, model, optimizer, scheduler,
                                   precision.scaler, acc, run, extra, config=asdict(config))
                memory = (f"peak {format_bytes(line['peak_bytes'])}" if line["peak_bytes"] is not None
                          else f"saved {format_bytes(line['activation_bytes'])}")
                # The throughput shown is the mean over this session's training steps, as the final summary's.
                progress.update(step + 1, f"loss {line['loss']:.3f} | {tokens / step_seconds:.0f} tok/s | {memory}")
                if stopped_by:
                    _log(f"{stopped_by} received: stopped after step {step + 1} with a checkpoint; continue with "
                         "--resume", rank)
                    break
    finally:
        watch.remove()
        progress.close()
        if metrics_log is not None:
            metrics_log.close()
    seconds = time.perf_counter() - start  # the whole session: evaluation, checkpoints and files included
    masters = optimizer.master_weights() if run_plan.settings.optimizer == "offload-bf16-weights" else {}
    if hasattr(optimizer, "close"):  # CPUOffloadOptimizer: its gradient hooks and worker thread end with the run
        optimizer.close()
    if writer and not stopped_by:
        _write_results(out, checkpoints, model, masters, metrics, run_plan, plan_check, replans, config, tokenizer,
                       global_batch, seq_len, device, world)
    elif out is not None and not stopped_by:
        model_state_dict(model)  # collective under FSDP2: every rank takes part in rank 0's gathering
    return TrainResult(
        steps=last["step"], tokens=tokens, seconds=seconds, final_loss=last["loss"],
        eval_loss=eval_loss, checkpointed_blocks=tuple(blocks), precision=precision_name, micro_batch_size=micro,
        accumulation=accumulation, activation_bytes=last["activation_bytes"],
        model_state_bytes=last["model_state_bytes"], peak_bytes=last["peak_bytes"], skipped_steps=acc.skipped_steps,
        resumed_from=resumed_from, stopped_by=stopped_by, out_dir=str(out) if out is not None else None,
        reasons=tuple(reasons), step_seconds=step_seconds, plan=run_plan.to_dict(), replans=len(replans),
    )


def _after_out_of_memory(run_plan: RunPlan, error: str, model: nn.Module, config: TrainConfig,
                         context: dict[str, Any], step: int, micro: int, world: int,
                         measured_peak: int | None) -> RunPlan:
    """The plan after a step ran out of memory: with the shortfall folded in, or (a model without blocks, so no
    plan) half the micro-batch."""
    if world > 1:
        raise MemtrainError(f"out of memory at step {step + 1} with a micro-batch of {micro} on one of several "
                            "ranks (the others cannot re-plan in step). To resolve this error, pass a smaller budget "
                            "(budget=) so that the plan leaves more room, or a smaller micro_batch_size.")
    if run_plan.plan is None:
        per_rank = context["global_batch"]  # one rank
        if micro == 1:
            raise MemtrainError(f"out of memory at step {step + 1} with a micro-batch of 1. To resolve this error, "
                                "pass offload_optimizer=True, a shorter seq_len, or a smaller model.")
        smaller = next(m for m in range(micro // 2, 0, -1) if per_rank % m == 0)
        s = replace(run_plan.settings, micro_batch_size=smaller, accumulation=per_rank // smaller)
        return replace(run_plan, settings=s, reasons=("no plan to correct (the model has no repeated blocks)",
                                                      f"micro-batch halved to {smaller}"))
    return replan(run_plan, model, config, why=f"out of memory at step {step + 1}",
                  shortfall_bytes=shortfall_after_oom(run_plan, error, measured_peak), **context)


def _replan_record(step: int, why: str, old: RunPlan, new: RunPlan) -> dict[str, Any]:
    """One entry of report.json's "replans": the step, why, the new settings, the correction, and both plans'
    peaks as the estimate alone predicts them (the correction left out)."""
    def raw(r: RunPlan) -> int | None:
        return r.plan.peak_bytes - r.correction_bytes if r.plan is not None else None

    return {"step": step + 1, "why": why, "settings": new.settings.to_dict(), "correction_bytes": new.correction_bytes,
            "estimated_peak_before": raw(old), "estimated_peak_after": raw(new)}


def _release_step(optimizer: torch.optim.Optimizer, device: torch.device, acc: GradientAccumulator,
                  precision: MixedPrecision) -> None:
    """Frees what a failed or finished step left (its partial gradients and window, a GradScaler's record of an
    unscale that no update followed, the allocator's cached blocks)."""
    optimizer.zero_grad(set_to_none=True)
    with contextlib.suppress(MemtrainError):  # not inside a micro-batch: its context has exited
        acc.discard_window()
    if precision.scaler is not None:
        # NOTE: GradScaler keeps "unscale_() already called" per optimizer until update(); a step that failed
        # between the two would make the retry's unscale_() raise. No public reset exists.
        precision.scaler._per_optimizer_states.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _write_results(out: Any, checkpoints: RunCheckpoints | None, model: nn.Module, masters: dict[int, torch.Tensor],
                   metrics: list[dict[str, Any]], run_plan: RunPlan, plan_check: dict[str, Any] | None,
                   replans: list[dict[str, Any]], config: TrainConfig, tokenizer: Any, global_batch: int,
                   seq_len: int, device: torch.device, world: int) -> None:
    """model.safetensors (fp32 masters where the device held bf16 copies), report.json with its plots,
    sample.txt, and hf/ for a Hugging Face model (the LoRA adapters, or with merge_lora the merged weights)."""
    state = model_state_dict(model)  # collective under FSDP2
    duplicates = tied_duplicates(model)  # tied weights once, under their first name
    names = {id(p): n for n, p in model.named_parameters()}
    for pid, master in masters.items():
        if names.get(pid) in state:
            state[names[pid]] = master
    state = {k: v for k, v in state.items() if k not in duplicates}
    with write_faults(out / "model.safetensors", checkpoints):
        save_weights_file(state, out / "model.safetensors")
    with write_faults(out / "report.json", checkpoints):
        report = write_run_report(out, metrics, run_plan, plan_check, replans, model, global_batch, seq_len, device,
                                  world)
    if report.get("without_memtrain_error"):
        _log(f"  report.json: no estimate of plain training ({report['without_memtrain_error']})")
    byte_level = tokenizer is None and getattr(getattr(model, "config", None), "vocab_size", 0) >= 256 \
        and chunked_loss_kind(model) == "gpt"
    if config.sample_bytes and world == 1 and (tokenizer is not None or byte_level):
        text = sample_text(model, "def ", config.sample_bytes, seq_len, seed=config.seed, tokenizer=tokenizer)
        with write_faults(out / "sample.txt", checkpoints):
            atomic_write_bytes(out / "sample.txt", text.encode())
    if is_hf_model(model):
        from memtrain.hf import merge_lora, save_hf

        with write_faults(out / "hf", checkpoints):
            save_hf(merge_lora(model) if config.merge_lora else model, out / "hf", tokenizer=tokenizer)


class _Progress:

    """A tqdm bar where stderr is a terminal; elsewhere (a log file, a pipe) one plain line every ``every`` steps,
    so that a log holds no carriage-return redraws."""

    def __init__(self, total: int, initial: int, *, enabled: bool, lines: int = 20):
        self.total = total
        terminal = enabled and sys.stderr.isatty()
        self.bar = (tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
                    if terminal else None)
        self.lines = enabled and not terminal
        self.every = max(1, total // lines)

    def update(self, step: int, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update()
        elif self.lines and (step % self.every == 0 or step == self.total):
            _log(f"step {step}/{self.total}: {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _one_step(train_model: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer, acc: GradientAccumulator,
              precision: MixedPrecision, measuring: bool, batches: Iterator[Any], accumulation: int,
              device: torch.device, step: int) -> dict[str, Any]:
    """One optimizer step: ``accumulation`` micro-batches, then the accumulator's boundary. ``measuring``: the
    first micro-batch's saved bytes are counted (not while activations are offloaded: hooks do not stack).

    On CUDA the step waits for the device once, at its end (its time must include the optimizer's kernels); the
    peak is read from the allocator's counters, which need no wait.
    """
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens = 0
    # synchronize=False: the meter must not stall the queue twice per step; it counts saved bytes on the host.
    meter = MemoryMeter(model, optimizer, synchronize=False)
    for i in range(accumulation):
        # Already on the device: DevicePrefetcher copied it during the previous compute.
        x, y, positions = _unpack(next(batches))
        with acc.micro_batch(is_last=i == accumulation - 1):
            # The meter counts what autograd saves in the first micro-batch: the figure checkpointing cuts.
            with meter if i == 0 and measuring else contextlib.nullcontext(), precision.autocast():
                loss = language_model_loss(train_model, x, y, positions)
            items = (y != -100).sum()
            acc.backward(loss, reduction="sum", items=items)  # token-count-correct over the window and ranks
        tokens += y.numel()
    report = meter.report()
    result = acc.step()  # unscale -> clip -> optimizer step -> scheduler -> zero_grad, once
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the step's one wait: its time includes the optimizer's kernels
    seconds = time.perf_counter() - t0
    state_bytes = optimizer_state_bytes(optimizer)
    return {
        "step": step + 1,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "skipped": result.skipped,
        "tokens": tokens,
        "seconds": seconds,
        "activation_bytes": report.activation_bytes if measuring else None,
        "parameter_bytes": report.parameter_bytes,
        "gradient_bytes": report.gradient_bytes,
        "optimizer_state_bytes": state_bytes,
        "model_state_bytes": report.parameter_bytes + report.gradient_bytes + state_bytes,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def _offloads_blocks(model: nn.Module) -> bool:
    spec_offloaders = [getattr(m, "_memtrain_checkpoint", None) for m in model.modules()]
    return any(spec is not None and spec.offloader is not None and spec.offloader.enabled for spec in spec_offloaders)


def _carry_counters(old: GradientAccumulator, new: GradientAccumulator) -> GradientAccumulator:
    new.load_state_dict(old.state_dict())
    return new


