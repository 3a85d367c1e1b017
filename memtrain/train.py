"""train(): one readable training loop built from memtrain's public pieces.

Read it top to bottom: set-up (each memory technique one visible line, each automatic choice printed with its
reason), then one optimizer step per iteration of the loop, then the run folder. Features that are off are
``nullcontext()``s, so the loop has no ``if`` per feature.
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
from torch.utils.data import Dataset, Sampler, Subset
from tqdm import tqdm

from memtrain.accumulation import GradientAccumulator, accumulation_steps
from memtrain.checkpointing import apply_checkpointing, find_blocks
from memtrain.data import DevicePrefetcher, make_loader
from memtrain.errors import ConfigError, MemtrainError
from memtrain.loss import apply_chunked_loss, chunk_tokens_of, chunked_loss_kind, supports_chunked_loss
from memtrain.measure import MemoryMeter, optimizer_state_bytes
from memtrain.offload import ActivationOffloader, offload_activations
from memtrain.precision import MixedPrecision, resolve_precision
from memtrain.report import check_estimate, format_bytes, write_run_report
from memtrain.runstate import (
    MetricsLog,
    RunCheckpoints,
    RunFolder,
    StopSignals,
    agree_on_stop,
    applied_changes,
    atomic_write_bytes,
    data_fingerprint,
    model_fingerprint,
    model_state_dict,
    restore_run_state,
    resume_run,
    save_run_state,
    save_weights_file,
    tied_duplicates,
    write_faults,
)

CheckpointingMode = Literal["none", "all", "every", "auto"]
PrecisionChoice = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"]
MAX_SEED = 2**63  # seeds are torch.Generator seeds (64 bits), plus one per epoch of the data


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs besides the model and the data. Memory effects are noted per field."""

    max_steps: int = 500
    micro_batch_size: int = 16  # examples per forward: activation memory grows with it
    global_batch_size: int | None = None  # examples per optimizer step, all ranks; None = micro x world size
    lr: float = 3e-3
    warmup_steps: int | None = None  # linear warm-up; None: min(50, max_steps // 10), so short runs reach lr
    min_lr_ratio: float = 0.1  # the cosine schedule decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0  # the global gradient norm is clipped to this; None: not clipped
    precision: PrecisionChoice = "auto"  # 16-bit halves most activation bytes
    checkpointing: CheckpointingMode = "auto"  # "all" cuts saved activations to the blocks' inputs
    checkpoint_every: int = 2  # with checkpointing="every": one block in this many
    offload_activations: bool = False  # True: saved activations wait in pinned host memory (CUDA only)
    offload_optimizer: bool = False  # True: fp32 master + AdamW state in host RAM (8-12 bytes/param off the device)
    chunked_loss: bool = True  # with checkpointing: the loss's fp32 logits 1024 tokens at a time, never whole
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
    progress: bool = True

    def validate(self) -> None:
        """Raises one ConfigError listing every bad field (each named as the argument, e.g. ``out_dir=``)."""
        problems = []
        for name in ("max_steps", "micro_batch_size", "checkpoint_every", "eval_every", "eval_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be an integer >= 1.")
        for name in ("global_batch_size", "save_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"{name}={value!r} must be an integer >= 1, or unset.")
        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not (number(self.lr) and self.lr > 0):
            problems.append(f"lr={self.lr!r} must be a positive number, e.g. 3e-3.")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool) or
                                              not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            problems.append(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0, or None for "
                            "min(50, max_steps // 10).")
        elif (isinstance(self.warmup_steps, int) and isinstance(self.max_steps, int)
              and self.warmup_steps > self.max_steps >= 1):
            problems.append(f"warmup_steps={self.warmup_steps} is more than max_steps={self.max_steps}: the learning "
                            f"rate would never reach lr. To resolve this error, pass warmup_steps={self.max_steps // 10}"
                            " or fewer, or leave it unset.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            problems.append(f"seed={self.seed!r} must be an integer in [0, 2**63). To resolve this error, pass e.g. "
                            "seed=0.")
        if not (number(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0):
            problems.append(f"min_lr_ratio={self.min_lr_ratio!r} must be a number in [0, 1].")
        if not (number(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"weight_decay={self.weight_decay!r} must be a number >= 0.")
        if self.grad_clip is not None and not (number(self.grad_clip) and self.grad_clip > 0):
            problems.append(f"grad_clip={self.grad_clip!r} must be a number > 0, or None for no clipping.")
        for name in ("fsdp", "offload_optimizer", "offload_activations", "chunked_loss", "compile", "overwrite",
                     "resume", "progress"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.checkpointing not in ("none", "all", "every", "auto"):
            problems.append(f"checkpointing={self.checkpointing!r} is not one of 'none', 'all', 'every' (one block in "
                            "checkpoint_every), 'auto'. To resolve this error, pass e.g. checkpointing='all', or "
                            "checkpointing='every' with checkpoint_every=2.")
        if self.precision not in ("auto", "fp32", "bf16-mixed", "fp16-mixed"):
            problems.append(f"precision={self.precision!r} is not one of auto, fp32, bf16-mixed, fp16-mixed.")
        if self.overwrite is True and self.resume is True:
            problems.append("overwrite=True and resume=True contradict each other. To resolve this error, pass "
                            "resume=True to continue the run in out_dir, or overwrite=True to start it again.")
        if (self.overwrite is True or self.resume is True) and not self.out_dir:
            problems.append("overwrite=True and resume=True need a run folder. To resolve this error, pass "
                            "out_dir='DIR'.")
        if self.offload_optimizer is True and self.fsdp is True:
            problems.append("offload_optimizer=True and fsdp=True together: FSDP2 shards the optimizer state itself "
                            "and CPUOffloadOptimizer needs whole parameters. To resolve this error, drop one of "
                            "offload_optimizer=True and fsdp=True.")
        if not isinstance(self.sample_bytes, int) or self.sample_bytes < 0:
            problems.append(f"sample_bytes={self.sample_bytes!r} must be an integer >= 0.")
        ConfigError.raise_if(problems)


@dataclass(frozen=True)
class TrainResult:
    steps: int  # optimizer steps completed, over the whole run (resumed runs included)
    tokens: int  # tokens trained on in this process's session, all ranks
    seconds: float
    final_loss: float
    eval_loss: float | None
    checkpointed_blocks: tuple[str, ...]
    precision: str
    micro_batch_size: int  # at the end (halved after an out-of-memory error)
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
def choose_checkpointing(model: nn.Module, config: TrainConfig) -> tuple[list[str], str]:
    """Applies the configured checkpointing; returns the wrapped blocks and the reason, for the log."""
    offload = config.offload_activations  # with checkpointing: the blocks' saved inputs go to host memory
    if config.checkpointing == "none":
        return [], "checkpointing off (--checkpointing none): every activation is kept"
    if config.checkpointing == "auto" and not find_blocks(model):
        return [], (f"checkpointing off, because: auto found no repeated blocks in {type(model).__name__} (no "
                    "nn.ModuleList/nn.Sequential of one module type, no Hugging Face _no_split_modules); to "
                    "checkpoint it, call apply_checkpointing(model, blocks=...) before train()")
    if config.checkpointing == "every":
        names = apply_checkpointing(model, every=config.checkpoint_every, offload=offload)
        return names, f"checkpointing {len(names)} blocks, one in {config.checkpoint_every} (--checkpointing every)"
    names = apply_checkpointing(model, offload=offload)
    if config.checkpointing == "auto":
        return names, (f"checkpointing all {len(names)} blocks, because: auto picks the smallest activation "
                       "memory for about one extra forward of time (--checkpointing none keeps them all)")
    return names, f"checkpointing all {len(names)} blocks (--checkpointing all)"


def choose_chunked_loss(model: nn.Module, config: TrainConfig, checkpointed: bool = True) -> str:
    """With checkpointing on, the loss 1024 tokens at a time (``apply_chunked_loss``); returns the reason."""
    if not config.chunked_loss or config.checkpointing == "none" or not checkpointed:
        return ""
    if not supports_chunked_loss(model):
        return f"; the loss on the whole batch's logits ({type(model).__name__}: no chunked loss for this model)"
    apply_chunked_loss(model)
    return (f"; the loss over {chunk_tokens_of(model)} tokens at a time, because: with the blocks checkpointed the "
            "batch's fp32 logits are the largest saved tensor (--no-chunked-loss keeps them)")


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


def language_model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy on fp32 logits (labels of -100 ignored); memtrain GPT or Hugging Face.

    ``y`` is already shifted (``y[t]`` follows ``x[t]``). A model with ``apply_chunked_loss`` computes it from its
    hidden states a chunk of tokens at a time, never holding the whole batch's logits.
    """
    kind = chunked_loss_kind(model)  # it looks inside DDP's and torch.compile's wrappers
    if kind == "gpt":
        return model(x, y, reduction="sum")
    if kind == "hf" and torch.is_grad_enabled():
        return model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=1).loss
    out = model(x)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _wrap_distributed(model: nn.Module, config: TrainConfig, device: torch.device, world: int) -> tuple[nn.Module, str]:
    """DDP or FSDP2 when several ranks run; the model itself otherwise."""
    if world == 1:
        if config.fsdp:
            raise ConfigError("fsdp=True needs several processes (torch.distributed with a world size > 1). To "
                              "resolve this error, launch under torchrun --nproc_per_node N, or drop fsdp=True.")
        return model, "one process: no gradient synchronisation"
    if config.fsdp:
        from torch.distributed.fsdp import fully_shard

        blocks = find_blocks(model)
        modules = dict(model.named_modules())
        for name in blocks:
            fully_shard(modules[name])  # after checkpointing: the recompute gathers the block's parameters again
        fully_shard(model)
        return model, f"FSDP2 over {world} ranks: {len(blocks)} blocks sharded, parameters gathered per block"
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids), f"DDP over {world} ranks"


def _build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device, precision: MixedPrecision,
                     world: int) -> tuple[torch.optim.Optimizer, str]:
    hyper = {"lr": config.lr, "betas": (0.9, 0.95), "weight_decay": config.weight_decay}
    if not config.offload_optimizer:
        # fused: one kernel per step (CUDA and CPU), and the same kernel CPUOffloadOptimizer runs on the host.
        return torch.optim.AdamW(model.parameters(), fused=True, **hyper), "AdamW (fused) on the device"
    from memtrain.optim_offload import CPUOffloadOptimizer

    # NOTE: under DDP, gradients stay on the device until the step: DDP averages them after the hooks that would
    # have copied them to the host. In one process they stream to the host during backward and leave the device.
    offload_gradients = world == 1
    optimizer = CPUOffloadOptimizer(model.named_parameters(), offload_gradients=offload_gradients,
                                    grad_scaler=precision.scaler, **hyper)
    where = "streamed to the host in backward" if offload_gradients else "kept on the device until the step (DDP)"
    return optimizer, (f"AdamW on the CPU (--offload-optimizer): fp32 master weights and state in host RAM, "
                       f"gradients {where}")


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, config: TrainConfig, device: torch.device,
             precision: MixedPrecision, batch_size: int) -> float:
    """Mean loss per token over the first ``eval_batches x micro_batch_size`` held-out examples (the same examples
    whatever micro-batch the run uses now, e.g. after an out-of-memory retry halved it)."""
    was_training = model.training
    model.eval()
    examples = Subset(dataset, range(min(len(dataset), config.eval_batches * config.micro_batch_size)))
    loader = make_loader(examples, batch_size=batch_size, num_workers=0, device=device)
    total, count = 0.0, 0
    for x, y in loader:
        with precision.autocast():
            total += language_model_loss(model, x.to(device), y.to(device)).item()
        count += int((y != -100).sum())
    model.train(was_training)
    return total / max(1, count)


@torch.no_grad()
def sample_text(model: nn.Module, prompt: bytes, n: int, seq_len: int, *, seed: int = 0) -> str:
    """``n`` bytes sampled after ``prompt`` (top-k 20), decoded as UTF-8 with replacement."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(n):
        out = model(idx[:, -seq_len:])
        logits = getattr(out, "logits", out)[:, -1, :256].float()
        kth = torch.topk(logits, 20).values[:, [-1]]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# -- the loop -----------------------------------------------------------------------------------------------
def train(model: nn.Module, data: Dataset | tuple[Dataset, Dataset], config: TrainConfig, *,
          command: Mapping[str, Any] | None = None) -> TrainResult:
    """Trains a language model on ``(x, y)`` token windows with every configured memory technique.

    Args:
        model: returns logits for token ids (memtrain's GPT, a Hugging Face causal LM), on its training device.
        data: training examples ``(x, y)``, or a ``(train, validation)`` pair.
        config: the run's settings. Under ``torchrun`` (torch.distributed initialised) the global batch is split
            over the ranks, gradients synchronise once per step (DDP, or FSDP2 with ``fsdp=True``) and only rank
            0 writes files.
        command: the flags of the command that started the run (``memtrain train`` passes its own), kept in the
            run folder's ``config.json`` so that a resume needs no other flag.

    Returns:
        A ``TrainResult``. With ``config.out_dir`` the run folder (marked ``.memtrain-run``, locked while the run
        uses it) holds ``config.json`` (written at the start), ``metrics.jsonl`` (one line appended per optimizer
        step), ``model.safetensors``, ``report.json``, ``sample.txt`` and resumable ``checkpoints/``.

    Raises:
        ConfigError: a bad config; an ``out_dir`` holding another run's results or files memtrain did not write
            (without overwrite/resume), or in use by another live run; a resume whose run-defining settings, data
            or model differ from the run's (each difference named).
        RunWriteError: a file of the run could not be written (a full disk, a read-only filesystem); the message
            names it and the last good checkpoint, which is intact.
        MemtrainError: out of memory even at a micro-batch of 1.
    """
    config.validate()
    if next(iter(model.parameters()), None) is None:
        raise ConfigError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train. To "
                          "resolve this error, pass a model with trainable parameters.")
    rank, world = _distributed()
    device = next(model.parameters()).device
    folder = None
    if config.out_dir:
        folder = RunFolder(config.out_dir, overwrite=config.overwrite, resume=config.resume)
        folder.check()  # every rank, before anything is written: all fail alike
    _take_folder(folder, rank, world, device)
    try:
        return _train(model, data, config, folder, command, rank, world, device)
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


def _train(model: nn.Module, data: Dataset | tuple[Dataset, Dataset], config: TrainConfig,
           folder: RunFolder | None, command: Mapping[str, Any] | None, rank: int, world: int,
           device: torch.device) -> TrainResult:
    train_data, val_data = data if isinstance(data, tuple) else (data, None)
    global_batch = config.global_batch_size or config.micro_batch_size * world
    accumulation = accumulation_steps(config.micro_batch_size, global_batch, world)
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

    # Set-up: each technique one line, each automatic choice with its reason.
    precision_name, precision_reason = resolve_precision(device, config.precision)
    precision = MixedPrecision(precision_name, device.type)
    # What defines the run: a resume that differs in any of these is refused, naming each difference.
    run = {"seed": config.seed, "global_batch_size": global_batch, "world_size": world, "seq_len": seq_len,
           "data": data_fingerprint(train_data), "model": model_fingerprint(model), "precision": precision_name,
           "lr": config.lr, "warmup_steps": config.warmup_steps, "min_lr_ratio": config.min_lr_ratio,
           "weight_decay": config.weight_decay, "grad_clip": config.grad_clip,
           "offload_optimizer": config.offload_optimizer, "fsdp": config.fsdp}
    blocks, checkpoint_reason = choose_checkpointing(model, config)
    checkpoint_reason += choose_chunked_loss(model, config, checkpointed=bool(blocks))
    # Without checkpointing, offload wraps the whole forward; with it, the blocks' inputs (set up above).
    offload = (offload_activations(model=model) if config.offload_activations and not blocks
               else contextlib.nullcontext())
    if config.offload_activations:
        where = "the checkpointed blocks' inputs" if blocks else "every saved activation above 1 MiB"
        checkpoint_reason += (f"; {where} offloaded to pinned host memory (--offload-activations)"
                              if device.type == "cuda" else
                              "; --offload-activations has no effect on a CPU-only run (no device memory to save)")
    ddp_model, dist_reason = _wrap_distributed(model, config, device, world)
    if config.compile:
        # After every technique and the distributed wrapper, as torch recommends: the compiled graph recomputes
        # the checkpointed blocks, and DDP's buckets split it. Evaluation and sampling stay eager.
        ddp_model = torch.compile(ddp_model)
        dist_reason += "; torch.compile on the training step (--compile: the first steps pay the compile time)"
    optimizer, optimizer_reason = _build_optimizer(model, config, device, precision, world)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, config) / config.lr)
    micro = config.micro_batch_size
    reasons = [precision_reason, checkpoint_reason, optimizer_reason, dist_reason,
               f"global batch {global_batch} = micro-batch {micro} x {accumulation} accumulation x {world} rank(s)",
               f"learning rate {config.lr:g} after {config.warmup_steps} warm-up steps"
               + (" (min(50, max_steps // 10))" if auto_warmup else "") + f", cosine to "
               f"{config.lr * config.min_lr_ratio:g} at step {config.max_steps}"]

    def make_accumulator(steps: int) -> GradientAccumulator:
        return GradientAccumulator(ddp_model, optimizer, steps=steps, scaler=precision.scaler, scheduler=scheduler,
                                   max_grad_norm=config.grad_clip)

    acc = make_accumulator(accumulation)
    notes = list(folder.notes) if writer else []  # what taking the folder found (stale locks, temporaries)
    start_step, resumed_from, estimate_check = 0, None, None
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
        estimate_check = state["extra"].get("estimate_check")
        if state["extra"].get("requested_micro_batch_size") == config.micro_batch_size:
            micro = int(state["micro_batch_size"])  # as the run left it (halved after an out-of-memory error)
            accumulation = global_batch // (micro * world)
            acc = _carry_counters(acc, make_accumulator(accumulation))
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
            folder.write_config(asdict(config), command)
            metrics, metric_notes = metrics_log.start(resume_step=start_step if config.resume else None)
        notes += metric_notes
    for line in notes:
        _log(f"  {line}", rank)
    # NOTE: saved-tensor hooks do not stack, so while activations are offloaded the meter stays out of the way
    # (on CUDA the allocator peak is the figure then).
    measuring = not (isinstance(offload, ActivationOffloader) and offload.enabled) and not _offloads_blocks(model)
    progress = _Progress(config.max_steps, start_step, enabled=config.progress and rank == 0)
    tokens, step_seconds, eval_loss, last, stopped_by = 0, 0.0, None, None, None
    start = time.perf_counter()
    try:
        with StopSignals() as signals:
            for step in range(start_step, config.max_steps):
                rng = torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
                lr = optimizer.param_groups[0]["lr"]  # this step's: the scheduler moves it on after the step
                while True:  # retried with half the micro-batch after an out-of-memory error
                    out_of_memory = False
                    try:
                        line = _one_step(ddp_model, model, optimizer, acc, precision, offload, measuring, batches,
                                         accumulation, device, step)
                        break
                    except torch.OutOfMemoryError:
                        out_of_memory = True
                    # Outside the except block: the traceback no longer pins the failed step's tensors.
                    if out_of_memory:
                        micro = _halve_after_oom(micro, global_batch // world, step, optimizer, device, rank)
                        accumulation = global_batch // (micro * world)
                        acc = _carry_counters(acc, make_accumulator(accumulation))
                        torch.set_rng_state(rng[0])  # the retry draws the same dropout masks
                        if rng[1] is not None:
                            torch.cuda.set_rng_state(rng[1], device)
                        batches = loader_from(step, micro)
                step_tokens, seconds = line.pop("tokens") * world, line.pop("seconds")
                tokens, step_seconds = tokens + step_tokens, step_seconds + seconds
                line["tokens_per_s"] = step_tokens / seconds  # all ranks' tokens in this step's time
                line["lr"] = lr
                if val_data is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.max_steps):
                    eval_loss = line["eval_loss"] = evaluate(model, val_data, config, device, precision, micro)
                metrics.append(line)
                last = line
                if step + 1 == min(2, config.max_steps) and rank == 0 and world == 1:
                    # From the second step on the optimizer state exists: the steady state estimate predicts.
                    estimate_check = check_estimate(model, line, micro, seq_len, device, precision_name,
                                                    estimate_policy(config.checkpointing if blocks else "none",
                                                                    config.checkpoint_every),
                                                    chunked_loss=chunked_loss_kind(model) is not None)
                    _log(f"  {estimate_check['log']}")
                if metrics_log is not None:
                    with write_faults(metrics_log.path, checkpoints):
                        metrics_log.append(line)
                stopped_by = agree_on_stop(signals.received, device)  # every rank stops after the same step
                due = config.save_every is not None and (step + 1) % config.save_every == 0
                if checkpoints is not None and (due or stopped_by or step + 1 == config.max_steps):
                    if metrics_log is not None:
                        with write_faults(metrics_log.path, checkpoints):
                            metrics_log.sync()  # no checkpoint is ever ahead of the durable metrics
                    save_run_state(checkpoints if rank == 0 else None, step + 1, micro, model, optimizer, scheduler,
                                   precision.scaler, acc, run, {"estimate_check": estimate_check,
                                                                "requested_micro_batch_size": config.micro_batch_size},
                                   config=asdict(config))
                memory = (f"peak {format_bytes(line['peak_bytes'])}" if line["peak_bytes"] is not None
                          else f"saved {format_bytes(line['activation_bytes'])}")
                # The throughput shown is the mean over this session's training steps, as the final summary's.
                progress.update(step + 1, f"loss {line['loss']:.3f} | {tokens / step_seconds:.0f} tok/s | {memory}")
                if stopped_by:
                    _log(f"{stopped_by} received: stopped after step {step + 1} with a checkpoint; continue with "
                         "--resume", rank)
                    break
    finally:
        progress.close()
        if metrics_log is not None:
            metrics_log.close()
    seconds = time.perf_counter() - start  # the whole session: evaluation, checkpoints and files included
    if hasattr(optimizer, "close"):  # CPUOffloadOptimizer: its gradient hooks and worker thread end with the run
        optimizer.close()

    final_state = model_state_dict(model) if out is not None and not stopped_by else None  # collective under FSDP2
    if final_state:  # tied weights once, under their first name, however the state dict was gathered
        duplicates = tied_duplicates(model)
        final_state = {k: v for k, v in final_state.items() if k not in duplicates}
    if writer and not stopped_by:
        with write_faults(out / "model.safetensors", checkpoints):
            save_weights_file(final_state, out / "model.safetensors")
        with write_faults(out / "report.json", checkpoints):
            report = write_run_report(out, metrics, estimate_check, model, global_batch, seq_len, device, world)
        if report.get("without_memtrain_error"):
            _log(f"  report.json: no estimate of plain training ({report['without_memtrain_error']})")
        if config.sample_bytes and world == 1:
            text = sample_text(model, b"def ", config.sample_bytes, seq_len, seed=config.seed)
            with write_faults(out / "sample.txt", checkpoints):
                atomic_write_bytes(out / "sample.txt", text.encode())
    return TrainResult(
        steps=last["step"], tokens=tokens, seconds=seconds, final_loss=last["loss"],
        eval_loss=eval_loss, checkpointed_blocks=tuple(blocks), precision=precision_name, micro_batch_size=micro,
        accumulation=accumulation, activation_bytes=last["activation_bytes"],
        model_state_bytes=last["model_state_bytes"], peak_bytes=last["peak_bytes"], skipped_steps=acc.skipped_steps,
        resumed_from=resumed_from, stopped_by=stopped_by, out_dir=str(out) if out is not None else None,
        reasons=tuple(reasons), step_seconds=step_seconds,
    )


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


def _one_step(ddp_model: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer, acc: GradientAccumulator,
              precision: MixedPrecision, offload: contextlib.AbstractContextManager[Any], measuring: bool,
              batches: Iterator[Any], accumulation: int, device: torch.device, step: int) -> dict[str, Any]:
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
        x, y = next(batches)  # already on the device: DevicePrefetcher copied it during the previous compute
        with acc.micro_batch(is_last=i == accumulation - 1):
            # The meter counts what autograd saves in the first micro-batch: the figure checkpointing cuts.
            with meter if i == 0 and measuring else contextlib.nullcontext(), precision.autocast(), offload:
                loss = language_model_loss(ddp_model, x, y)
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


def _halve_after_oom(micro: int, per_rank_batch: int, step: int, optimizer: torch.optim.Optimizer,
                     device: torch.device, rank: int) -> int:
    if micro == 1 or _distributed()[1] > 1:
        raise MemtrainError(
            f"out of memory at step {step + 1} with a micro-batch of {micro}"
            + (" on one of several ranks (the others cannot retry in step)" if micro > 1 else "")
            + ". To resolve this error, pass a smaller micro_batch_size, checkpointing='all', "
            "offload_optimizer=True, or a shorter seq_len."
        )
    optimizer.zero_grad(set_to_none=True)  # the failed step's partial gradients
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    smaller = next(m for m in range(micro // 2, 0, -1) if per_rank_batch % m == 0)
    _log(f"out of memory at step {step + 1} with micro-batch {micro}: retrying the step with micro-batch "
         f"{smaller} and {per_rank_batch // smaller} accumulation steps (global batch unchanged)", rank)
    return smaller


def estimate_policy(mode: str, every: int) -> str:
    """The estimator's name for a checkpointing mode ("auto" checkpoints every block, as train does)."""
    return {"none": "none", "every": f"every:{every}"}.get(mode, "all")


def _carry_counters(old: GradientAccumulator, new: GradientAccumulator) -> GradientAccumulator:
    new.load_state_dict(old.state_dict())
    return new


