"""train(): plan -> apply -> loop, built from memtrain's public pieces.

Read it top to bottom: ``train`` checks the config and takes the run folder; ``_train`` makes the plan
(``memtrain.run.replan.plan_for_run``: the config's fixed choices kept, the rest chosen by ``memtrain.planner`` to fit
the budget, each with its reason), applies it (``apply_plan``), resumes and commits the folder; ``_loop`` runs one
optimizer step per iteration (checked against the plan at step 2, re-planned when the device disagrees) and
``_finish`` writes the run folder's results. What a re-plan changes lives in one ``Session``.

``TrainConfig``, ``TrainResult`` and their constants live in ``memtrain.config``; this module re-exports them.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import Dataset, Subset
from tqdm import tqdm

from memtrain import techniques
from memtrain.accumulation import GradientAccumulator, accumulation_steps
from memtrain.checkpointing import compile_model
from memtrain.choices import default_global_batch
from memtrain.config import TrainConfig, TrainResult
from memtrain.data import DevicePrefetcher, StepBatches, make_loader, map_tensors
from memtrain.device import accelerator
from memtrain.device.allocator import allocator_reason, configure_allocator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.loss import language_model_loss
from memtrain.message import WHATEVER, arg, marked
from memtrain.planner import AppliedPlan, PlanSettings, apply_plan, configure_model
from memtrain.precision import MixedPrecision, resolve_precision
from memtrain.report import format_bytes
from memtrain.run import (
    MetricsLog,
    RunCheckpoints,
    RunFolder,
    RunWriteError,
    StopNow,
    StopSignals,
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
from memtrain.run.export import export_results
from memtrain.run.gathered import hf_weights, write_gathered_weights
from memtrain.run.identity import RunIdentity
from memtrain.run.plan_check import check_step
from memtrain.run.replan import (
    PlanInForce,
    RunContext,
    flat_settings,
    plan_after_out_of_memory,
    plan_for_run,
    plan_request,
    read_plan_request,
    replan,
    replan_record,
)
from memtrain.run.report import plan_summary, write_run_report
from memtrain.run.state import CheckpointExtra, PlanCheck
from memtrain.run.step import CountedBatches, StepFigures, kept_share, one_step, unpack_batch
from memtrain.schedule import lr_at, lr_scheduler, resolve_schedule, resumed_reasons
from memtrain.unwrap import is_fsdp2

MAX_REPLANS_PER_STEP = 4  # out of memory again after this many re-plans of one step: an error, not a loop


def _log(message: str, rank: int = 0) -> None:
    if rank == 0:
        tqdm.write(message, file=sys.stderr)


# -- pieces of the loop -------------------------------------------------------------------------------------
def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, config: TrainConfig, device: torch.device,
             precision: MixedPrecision, batch_size: int, examples: int) -> float:
    """Mean loss per token over ``examples`` held-out examples spread evenly over ``dataset`` (the same ones
    whatever micro-batch the run uses now, e.g. after a re-plan changed it). Not the first ones: those are one
    stretch of text (the built-in corpus's first held-out file, queue.py, scores far below the training loss)."""
    was_training = model.training
    model.eval()
    acc = accelerator(device)
    chosen = [i * len(dataset) // min(len(dataset), examples) for i in range(min(len(dataset), examples))]
    # seed=: the loader's iterator draws from its own generator; the global one is the training's dropout's.
    loader = make_loader(Subset(dataset, chosen), batch_size=batch_size, num_workers=0, device=device,
                         seed=config.seed)
    total, count = 0.0, 0
    for batch in loader:
        x, y, positions = unpack_batch(map_tensors(acc.to_device, batch))
        with acc.compute(), precision.autocast():  # the device's work, as a training step's
            total += language_model_loss(model, x, y, positions).item()
        count += int((y != -100).sum())
    model.train(was_training)
    return total / max(1, count)


# -- what the loop changes as it goes -----------------------------------------------------------------------
class Session:
    """The run's mutable state: the plan it follows now and what follows from it (the training model and its
    checkpointed blocks, the micro-batch, the accumulation, the accumulator, the batches), with the plan check
    and the re-plans so far. The model, the optimizer and its state stay through every change of plan."""

    def __init__(self, planned: AppliedPlan, in_force: PlanInForce, config: TrainConfig, context: RunContext,
                 train_data: Dataset, rank: int):
        self.model, self.train_model, self.optimizer = planned.model, planned.train_model, planned.optimizer
        self.acc, self.precision, self.blocks = planned.accumulator, planned.precision, planned.blocks
        self.scheduler = self.acc.scheduler
        self.in_force = in_force
        self.micro, self.accumulation = in_force.settings.micro_batch_size, in_force.settings.accumulation
        self.plan_check: PlanCheck | None = None  # the plan against the device at its second step
        self.replans: list[dict[str, Any]] = []  # report.json's "replans"
        self.batches: Iterator[Any] = iter(())
        self._config, self._context, self._train_data, self.rank = config, context, train_data, rank
        self.device = context.device  # whose random generator a checkpoint saves

    def follow(self, new: PlanInForce) -> None:
        """Switches the model to a re-plan (or a resumed run's plan): the optimizer and its state stay."""
        self.in_force = new
        if new.settings.blocks:
            self.blocks = configure_model(self.model, new.settings)
            if new.settings.compile:  # blocks that now offload cannot stay in a whole-model graph
                self.train_model = compile_model(self.train_model)
        self.micro, self.accumulation = new.settings.micro_batch_size, new.settings.accumulation
        acc = GradientAccumulator(self.train_model, self.optimizer, steps=self.accumulation,
                                  scaler=self.precision.scaler, scheduler=self.scheduler,
                                  max_grad_norm=self._config.grad_clip)
        acc.load_state_dict(self.acc.state_dict())  # the counters carry over
        self.acc = acc

    def load_from(self, step: int) -> str:
        """The batches from optimizer step ``step`` on, in micro-batches of the plan's size; returns the
        loader's settings (for the log)."""
        c = self._context
        sampler = StepBatches(len(self._train_data), c.global_batch, self.micro, seed=self._config.seed,
                              start=step, rank=self.rank, world=c.world)
        # NOTE: no workers: a window is a numpy slice, so loading costs microseconds and a worker adds only IPC.
        # seed=: a new iterator draws its workers' base seed from the loader's own generator, not the global one
        # whose next draws are this step's dropout masks (a resume makes a new iterator where a straight run
        # does not).
        loader = make_loader(self._train_data, batch_sampler=sampler, device=c.device, num_workers=0,
                             seed=self._config.seed)
        self.batches = iter(DevicePrefetcher(CountedBatches(loader), c.device))
        return loader.memtrain_settings.summary()


class OptimizerStepWatch:
    """Whether an optimizer (any: step-in-backward steps inner ones during backward) began a step since
    ``began`` was last set to False: after that an out-of-memory error cannot be retried without applying the
    step twice to some parameters."""

    def __enter__(self) -> OptimizerStepWatch:
        self.began = False
        self._hook = register_optimizer_step_pre_hook(self._saw)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()

    def _saw(self, *_: object) -> None:
        self.began = True


@dataclass
class Tally:
    """What the loop counts over this session, for ``TrainResult``."""

    tokens: int = 0  # all ranks'
    step_seconds: float = 0.0  # inside training steps
    eval_loss: float | None = None  # the latest
    last: StepFigures | None = None  # the latest step's
    stopped_by: str | None = None  # the signal that ended the run early
    start: float = field(default_factory=time.perf_counter)  # the loop's start


# -- the loop -----------------------------------------------------------------------------------------------
def train(model: nn.Module, data: Dataset | tuple[Dataset, Dataset], config: TrainConfig, *,
          command: Mapping[str, Any] | None = None, tokenizer: Any = None,
          device: torch.device | str | None = None) -> TrainResult:
    """Trains a language model: plan -> apply -> loop.

    The plan (``memtrain.planner``) fits the budget (``config.budget``; unset: what the device has free) at the
    highest predicted tokens/s, keeping every choice the config fixes; ``apply_plan`` sets it up; after step 2 the
    plan is checked against the device (CUDA: the allocator's peak; CPU: the saved bytes), and a peak over the
    budget or an out-of-memory error makes a new plan with the shortfall folded into the estimate, on the same
    global batch and data order.

    Args:
        model: returns logits for token ids (memtrain's GPT, a Hugging Face causal LM, a PEFT LoRA model: only
            the parameters that require grad train), on the CPU (with ``device``: the plan places it there part
            by part, never whole first) or on its training device.
        data: training examples, windows ``(x, y)`` or ``memtrain.data.PackedRows``, or a ``(train,
            validation)`` pair.
        config: the run's settings. Under ``torchrun`` (torch.distributed initialised) the global batch is split
            over the ranks, gradients synchronise once per step (DDP, or FSDP2 with ``fsdp=True``) and only rank
            0 writes files.
        command: the flags of the command that started the run (``memtrain train`` passes its own), kept in the
            run folder's ``config.json`` so that a resume needs no other flag.
        tokenizer: the model's tokenizer, saved into ``hf/`` and used for the text sample.
        device: where to train (None: where the model is). A model on the CPU trained on an accelerator is placed
            by ``apply_plan`` as the plan says (streamed block weights stay in host memory, an offloaded
            optimizer's masters come from the host weights), so the device never holds more than the plan does.

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
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={model!r:.80} is a {type(model).__name__}, not a torch nn.Module: train() takes the "
                          "model itself, not its name. To resolve this error, build the model first, e.g. "
                          "memtrain.hf.load_pretrained(DIR) for a Hugging Face folder or memtrain.models.GPT("
                          "memtrain.models.GPT_PRESETS['gpt-tiny']) (memtrain train takes names: --hf-model, "
                          "--model).")
    # A dict is refused, not converted: TrainConfig is the settings' one spelling, and building it checks the keys.
    if not isinstance(config, TrainConfig):
        raise ConfigError(f"config is a {type(config).__name__}, not a TrainConfig. To resolve this error, pass "
                          + ("TrainConfig(**that_dict), which checks its keys" if isinstance(config, Mapping) else
                             "memtrain.TrainConfig(max_steps=..., ...)") + ".")
    config.validate()
    if next(iter(model.parameters()), None) is None:
        raise ConfigError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train. To "
                          "resolve this error, pass a model with trainable parameters.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"no parameter of the model ({type(model).__name__}) requires grad: there is nothing to "
                          "train. To resolve this error, unfreeze some (e.g. apply_lora(model, r=8) adds adapters).")
    rank, world = _distributed()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    configure_allocator(device)  # before anything starts CUDA: the allocator reads its settings then
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
        except (ConfigError, RunWriteError) as e:  # a bad folder, or a disk with no room for the lock
            error = e
    if world > 1:
        # Each problem with the arguments it names kept, so that every rank raises rank 0's error as it is.
        box = [None if error is None else [marked(p) for p in getattr(error, "problems", [error.message])]]
        dist.broadcast_object_list(box, src=0, device=device if "nccl" in dist.get_backend() else None)
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
    global_batch = _global_batch(config, world, len(train_data))
    config.choices.check_run(world_size=world, fsdp=config.fsdp)  # what a run of `world` ranks cannot take
    # Nothing in the folder changes before every check below has passed (taking it is undone if one fails).
    out = folder.path if folder is not None else None
    checkpoints = RunCheckpoints(out) if out is not None else None
    writer = rank == 0 and out is not None
    # max_steps (from epochs), lr and warm-up fixed at the start: lr_at reads this config.
    config, schedule_reasons, auto = resolve_schedule(config, model, len(train_data), global_batch)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model.train()

    # Plan: every choice the config leaves open, to fit the budget; each with its reason.
    asked, because = techniques.asked_precision(config.choices, config.precision)
    precision_name, precision_reason = resolve_precision(device, asked, because=because)
    context = RunContext(seq_len=len(train_data[0][0]), global_batch=global_batch, device=device, world=world,
                         precision=precision_name, packed=len(train_data[0]) > 2,  # PackedRow: position_ids
                         precision_reason=precision_reason, kept_share=kept_share(train_data))
    started_with = _saved_plan(out) if config.resume else None  # a resume keeps the run's optimizer
    fingerprints = data_fingerprint(train_data), model_fingerprint(model)  # before the plan configures the model
    in_force = plan_for_run(model, config, context, keep_optimizer=started_with)
    first = in_force.settings
    # What defines the run: a resume that differs in any of these is refused, naming each difference.
    run = RunIdentity(seed=config.seed, global_batch_size=global_batch, world_size=world, seq_len=context.seq_len,
                      data=fingerprints[0], model=fingerprints[1], precision=precision_name, lr=config.lr,
                      warmup_steps=config.warmup_steps, min_lr_ratio=config.min_lr_ratio,
                      weight_decay=config.weight_decay, grad_clip=config.grad_clip, fsdp=config.fsdp,
                      lr_schedule=config.lr_schedule, adam_betas=tuple(config.adam_betas), adam_eps=config.adam_eps,
                      offload_optimizer=first.optimizer != "device", optimizer=first.optimizer_text)

    # Apply: the model configured in place, the optimizer and accumulator the plan asks for.
    planned = apply_plan(model, first, lr=config.lr, betas=tuple(config.adam_betas), eps=config.adam_eps,
                         weight_decay=config.weight_decay, max_grad_norm=config.grad_clip,
                         scheduler=lr_scheduler(lambda: config),  # a resume may replace config: read at each step
                         device=device)
    session = Session(planned, in_force, config, context, train_data, rank)
    reasons = _reasons(in_force, precision_reason, schedule_reasons, context, config, val_data)

    # Resume: the checkpoint's state, and the plan the run left off with.
    notes = list(folder.notes) if writer else []  # what taking the folder found (stale locks, temporaries)
    start_step = 0
    if config.resume:
        config, start_step, run = _resume(session, model, config, context, checkpoints, run, auto, notes)
        reasons = resumed_reasons(reasons, config, start_step)  # the schedule as it continues, not as it began
    reasons += session.load_from(start_step).splitlines()
    for text in [plan_summary(session.in_force, precision_name)] if config.quiet else reasons:
        _log(f"  {text}", rank)
    metrics: list[dict[str, Any]] = []
    metrics_log = MetricsLog(out / "metrics.jsonl", log=config.log) if writer else None
    if writer:  # set-up succeeded: now the folder may change
        metrics = _commit_folder(folder, config, command, started_with or first, checkpoints, metrics_log,
                                 start_step, notes)
        metrics_log.add_text("plan", reasons)  # TensorBoard's text tab (quiet or not)
    for text in notes:
        _log(f"  {text}", rank)

    tally = _loop(session, config, context, run, start_step, val_data, checkpoints, metrics_log, metrics)
    return _finish(session, tally, config, context, out, checkpoints, metrics, tokenizer, writer,
                   precision_name, reasons, resumed_from=start_step if config.resume else None)


def _global_batch(config: TrainConfig, world: int, examples: int) -> int:
    """The examples per optimizer step over all ranks, checked against the ranks and the data."""
    if config.fsdp and world == 1:
        raise ConfigError(f"{arg('fsdp', True)} needs several processes (torch.distributed with a world size > 1). To "
                          f"resolve this error, launch under torchrun --nproc_per_node N, or drop {arg('fsdp', True)}.")
    global_batch = config.global_batch_size or default_global_batch(world, config.micro_batch_size)
    if config.micro_batch_size is not None:
        accumulation_steps(config.micro_batch_size, global_batch, world)  # a clear error when it does not divide
    elif global_batch % world:
        raise ConfigError(f"{arg('global_batch_size', global_batch)} does not split over {world} ranks. To resolve "
                          f"this error, pass a multiple of {world}.")
    if examples < global_batch:
        raise ConfigError(f"the training data holds {examples} examples, fewer than one global batch of "
                          f"{global_batch}. To resolve this error, lower {arg('global_batch_size')} or use more data.")
    return global_batch


def _eval_examples(config: TrainConfig, context: RunContext) -> int:
    return config.eval_batches * (config.micro_batch_size or context.global_batch // context.world)


def _reasons(in_force: PlanInForce, precision_reason: str, schedule_reasons: list[str], context: RunContext,
             config: TrainConfig, val_data: Dataset | None) -> list[str]:
    """The lines the run logs at its start: the precision, the plan, the batch, the learning rate and the
    evaluation."""
    s = in_force.settings
    allocator = allocator_reason(context.device)
    reasons = [precision_reason, *([allocator] if allocator else []), *in_force.reasons,
               f"global batch {context.global_batch} = micro-batch {s.micro_batch_size} x {s.accumulation} "
               f"accumulation x {context.world} rank(s)", *schedule_reasons]
    if val_data is not None:  # spread: a held-out part's first examples are one stretch of text, easier or not
        reasons.append(f"eval loss every {config.eval_every} steps on {min(len(val_data), _eval_examples(config, context))}"
                       f" held-out examples spread evenly over all {len(val_data)}, so it compares with the training loss")
    if in_force.plan is not None:
        p = in_force.plan
        reasons.insert(1, f"plan: {s.checkpointing} checkpointing, loss {s.loss_text}, "
                          f"optimizer {s.optimizer_text}{', compiled' if s.compile else ''}; predicted peak "
                          f"{format_bytes(p.peak_bytes)} per rank, {p.tokens_per_s:,.0f} tokens/s "
                          f"(planned in {p.plan_seconds:.1f} s)")
    return reasons


def _resume(s: Session, model: nn.Module, config: TrainConfig, context: RunContext,
            checkpoints: RunCheckpoints | None, run: RunIdentity, auto: dict[str, bool],
            notes: list[str]) -> tuple[TrainConfig, int, RunIdentity]:
    """Restores the newest intact checkpoint and the plan the run left off with (``s.follow``); returns the
    config and the run's identity (with the run's own automatic lr and warm-up) and the step to continue from.
    What it found is added to ``notes``."""
    def restore(step: int, state: dict[str, Any]) -> None:
        if step >= config.max_steps:
            raise ConfigError(f"resume: the run in {str(checkpoints.root.parent)!r} already reached step {step} "
                              f"of {arg('max_steps', config.max_steps)}. To resolve this error, pass a larger "
                              f"{arg('max_steps')} to continue it.")
        restore_run_state(step, state, model, s.optimizer, s.scheduler, s.precision.scaler, s.acc,
                          device=context.device)

    # An automatic warm-up and lr are the run's own: a longer max_steps (or new defaults) must not move them.
    start_step, state, skipped = resume_run(checkpoints, replace(run, **{k: None for k in auto if auto[k]}), restore)
    kept = {k: state["run"][k] for k in ("lr", "warmup_steps") if auto[k] and isinstance(state["run"].get(k), (int, float))}
    config, run = replace(config, **kept), replace(run, **kept)
    # The optimizer comes back with the rate the old schedule set for this step; a changed max_steps moves it.
    for group, base in zip(s.optimizer.param_groups, s.scheduler.base_lrs, strict=True):
        group["lr"] = base * lr_at(s.scheduler.last_epoch, config) / config.lr
    notes += [f"skipped a damaged checkpoint: {problem}; using the previous one" for problem in skipped]
    notes += applied_changes(flat_settings(state.get("config", {})), flat_settings(config.to_dict()))
    if state["run"].get("world_size") != run.world_size:  # RESHARDED: the same examples at each step
        notes.append(f"resume: {run.world_size} rank(s) now, {state['run'].get('world_size')} in the run being resumed "
                     f"(its state read onto this layout; each step's {run.global_batch_size} examples the same; each "
                     "rank's micro-batches other ones, so dropout draws other masks for them: not bit for bit the "
                     "run's continuation)")
    extra = CheckpointExtra.from_dict(state["extra"])
    s.plan_check, s.replans = extra.plan_check, list(extra.replans)
    left = extra.plan_settings
    if read_plan_request(extra.plan_request) == plan_request(config):
        # The memory settings are the run's: continue on the plan it left off with (re-planned ones too).
        if left != s.in_force.settings:
            try:
                s.follow(plan_for_run(model, config, context, settings=left, keep_optimizer=left,
                                      correction_bytes=extra.correction_bytes))
            except ConfigError as e:
                notes.append(f"resume: the run's last plan does not fit now ({e}); the new plan applies")
                s.plan_check = None  # a plan this session adopts: checked at its second step
    else:
        notes.append("resume: the memory settings changed, so the run continues on a new plan")
        s.plan_check = None
    notes.append(f"resumed from step {start_step} (micro-batch {s.micro})")
    return config, start_step, run


def _commit_folder(folder: RunFolder, config: TrainConfig, command: Mapping[str, Any] | None,
                   started_with: PlanSettings, checkpoints: RunCheckpoints | None, metrics_log: MetricsLog,
                   start_step: int, notes: list[str]) -> list[dict[str, Any]]:
    """Marks the run folder as this run's (with overwrite, the old run's files go: memtrain's only), writes
    config.json and opens metrics.jsonl; returns the metrics so far (a resume's). Rank 0, after the set-up
    succeeded: only now may the folder change."""
    with write_faults(folder.path, checkpoints):
        folder.commit()
        folder.write_config(config.to_dict(), command, plan=started_with.to_dict())
        metrics, metric_notes = metrics_log.start(resume_step=start_step if config.resume else None)
    notes += metric_notes
    return metrics


def _loop(s: Session, config: TrainConfig, context: RunContext, run: RunIdentity, start_step: int,
          val_data: Dataset | None, checkpoints: RunCheckpoints | None, metrics_log: MetricsLog | None,
          metrics: list[dict[str, Any]]) -> Tally:
    """One optimizer step per iteration, from ``start_step`` to ``config.max_steps`` (or a signal)."""
    device, world, rank = context.device, context.world, s.rank
    eval_examples = _eval_examples(config, context)
    # The step whose measurement is compared with the plan: the session's second (its first may still warm the
    # allocator up); a plan checked before (a resume of a run past it) is not checked again.
    check_at = min(start_step + 2, config.max_steps) if s.plan_check is None else None
    progress = _Progress(config.max_steps, start_step, enabled=config.progress and rank == 0)
    tally = Tally()
    closing_log = contextlib.closing(metrics_log) if metrics_log is not None else contextlib.nullcontext()
    signals = StopSignals(distributed=world > 1, checkpoints=checkpoints, model=s.model, plan=s.in_force.plan)
    with contextlib.closing(progress), closing_log, OptimizerStepWatch() as watch, signals:
        for step in range(start_step, config.max_steps):
            # -- one optimizer step (out of memory: again on a new plan, same examples, same random draws) ---
            lr = s.optimizer.param_groups[0]["lr"]  # this step's: the scheduler moves it on after the step
            try:  # a second signal (or the first in a step predicted long) abandons the step within seconds
                with signals.step(step + 1, device):
                    figures = _step_retrying_out_of_memory(s, step, watch, config, context, signals.check)
            except StopNow as stop:
                _stop_mid_step(s, step, stop, watch.began, config, run, checkpoints, metrics_log, signals, tally)
                break
            tally.tokens += figures.tokens * world
            tally.step_seconds += figures.seconds
            figures.tokens_per_s = figures.tokens * world / figures.seconds  # all ranks' tokens in the step's time
            figures.lr = lr

            # -- evaluate once in a while --------------------------------------------------------------------
            if val_data is not None and ((step + 1) % config.eval_every == 0 or step + 1 == config.max_steps):
                tally.eval_loss = figures.eval_loss = evaluate(s.model, val_data, config, device, s.precision,
                                                               s.micro, eval_examples)
            row = figures.to_dict()  # metrics.jsonl's line
            metrics.append(row)
            tally.last = figures

            # -- check the plan at step 2 (from then on the optimizer state exists: the steady state) --------
            if step + 1 == check_at and rank == 0:
                _check_plan(s, step, figures, config, context)

            # -- log -----------------------------------------------------------------------------------------
            if metrics_log is not None:
                with write_faults(metrics_log.path, checkpoints):
                    metrics_log.append(row)

            # -- save: every save_every steps, at the end, and on a signal -----------------------------------
            tally.stopped_by = signals.agree(device)  # every rank stops after the same step
            due = config.save_every is not None and (step + 1) % config.save_every == 0
            if checkpoints is not None and (due or tally.stopped_by or step + 1 == config.max_steps):
                _save(s, step, config, run, checkpoints, metrics_log)
            memory = (f"peak {format_bytes(figures.peak_bytes)}" if figures.peak_bytes is not None
                      else f"saved {format_bytes(figures.activation_bytes)}")
            # The throughput shown is the mean over this session's training steps, as the final summary's.
            progress.update(step + 1, f"loss {figures.loss:.3f} | {tally.tokens / tally.step_seconds:.0f} tok/s | "
                                      f"{memory}")

            # -- stop on a signal ----------------------------------------------------------------------------
            if tally.stopped_by:
                _log(f"{tally.stopped_by} received: stopped after step {step + 1} with a checkpoint; continue "
                     "with --resume", rank)
                break
    return tally


def _stop_mid_step(s: Session, step: int, stop: StopNow, began: bool, config: TrainConfig, run: RunIdentity,
                   checkpoints: RunCheckpoints | None, metrics_log: MetricsLog | None, signals: StopSignals,
                   tally: Tally) -> None:
    """Step ``step`` (from 0) abandoned by a signal: its gradients and draws undone, the last finished step saved
    (unless on disk already, or this step updated parameters); the result's step is the last finished one."""
    signals.stopping()
    tally.stopped_by = stop.signal_name
    _release_step(s, next(s.model.parameters()).device)
    signals.restore_draws()  # the checkpoint holds the draws an uninterrupted run makes from here
    if checkpoints is not None and not began and step > 0 and signals.last_saved != step:
        _save(s, step - 1, config, run, checkpoints, metrics_log)
    _log(signals.abandoned(stop, step + 1, began), s.rank)
    tally.last = tally.last or StepFigures(step, float("nan"), float("nan"), False, 0, 0.0, None, 0, 0, 0, 0, None)


def _step_retrying_out_of_memory(s: Session, step: int, watch: OptimizerStepWatch, config: TrainConfig,
                                 context: RunContext, check_stop: Callable[[], None]) -> StepFigures:
    """One optimizer step; after an out-of-memory error, the step again on a new plan (at most
    ``MAX_REPLANS_PER_STEP`` times) from the same examples with the same random draws (dropout masks)."""
    device, acc = context.device, accelerator(context.device)
    rng = torch.get_rng_state(), acc.get_rng_state()
    for attempt in itertools.count():
        watch.began = False
        try:
            return one_step(s, step, device, check_stop)
        except torch.OutOfMemoryError as e:
            error = str(e)  # the message only: the traceback would pin the step's tensors
        measured_peak = acc.max_memory_allocated() if acc.tracks_memory else None
        if watch.began:
            raise MemtrainError(
                f"out of memory at step {step + 1} after some parameters had already been updated "
                f"(optimizer {s.in_force.settings.optimizer_text}: stepping in backward, or inside the "
                "optimizer step): a retry would apply this step twice to them; checkpoints already written are "
                f"intact. To resolve this error, resume from the last ({arg('resume', True)}) with a smaller "
                f"{arg('budget', WHATEVER)} or {arg('optimizer.step_in_backward', False)}.")
        _release_step(s, device)
        if attempt == MAX_REPLANS_PER_STEP:
            raise MemtrainError(f"out of memory at step {step + 1} after {attempt} re-plans (the last: "
                                f"micro-batch {s.micro}, checkpointing {s.in_force.settings.checkpointing}). "
                                f"To resolve this error, pass a smaller {arg('budget', WHATEVER)} (the plan then "
                                f"leaves more room), {arg('optimizer.placement', 'offload')}, or a shorter "
                                f"{arg('seq_len')}.")
        new = plan_after_out_of_memory(s.in_force, error, s.model, config, context, step, measured_peak)
        _log(f"out of memory at step {step + 1} with micro-batch {s.micro}: " + "; ".join(new.reasons[:2])
             + f"; now micro-batch {new.settings.micro_batch_size} x {new.settings.accumulation}, "
             f"checkpointing {new.settings.checkpointing} (global batch unchanged)", s.rank)
        s.replans.append(replan_record(step, "out of memory", s.in_force, new))
        s.follow(new)
        torch.set_rng_state(rng[0])  # the retry draws the same dropout masks
        if rng[1] is not None:
            acc.set_rng_state(rng[1])
        s.load_from(step)
    raise AssertionError("unreachable")  # the loop above returns or raises


def _check_plan(s: Session, step: int, figures: StepFigures, config: TrainConfig, context: RunContext) -> None:
    """The plan against the device (``check_step``); a peak over the budget re-plans (one rank, steps
    left)."""
    s.plan_check = check_step(s.in_force, figures.step, figures.peak_bytes, figures.activation_bytes, context.device,
                              can_replan=context.world == 1 and step + 1 < config.max_steps)
    _log(f"  {s.plan_check.log}")
    if s.plan_check.replanning:
        _release_step(s, context.device)
        new = replan(s.in_force, s.model, config, context, why=f"a peak over the budget at step {step + 1}",
                     shortfall_bytes=s.plan_check.measured_bytes - s.plan_check.predicted_bytes)
        for reason in new.reasons[:2]:
            _log(f"  {reason}")
        s.replans.append(replan_record(step, "peak over the budget", s.in_force, new))
        s.follow(new)
        s.load_from(step + 1)


def _save(s: Session, step: int, config: TrainConfig, run: RunIdentity, checkpoints: RunCheckpoints,
          metrics_log: MetricsLog | None) -> None:
    """A run checkpoint after step ``step`` (counted from 0), metrics.jsonl made durable first."""
    if metrics_log is not None:
        with write_faults(metrics_log.path, checkpoints):
            metrics_log.sync()  # no checkpoint is ever ahead of the durable metrics
    extra = CheckpointExtra(plan_check=s.plan_check, plan_settings=s.in_force.settings,
                            plan_request=plan_request(config), correction_bytes=s.in_force.correction_bytes,
                            replans=tuple(s.replans))
    save_run_state(checkpoints if s.rank == 0 else None, step + 1, s.micro, s.model, s.optimizer, s.scheduler,
                   s.precision.scaler, s.acc, run, extra, config=config.to_dict(), device=s.device)


def _finish(s: Session, tally: Tally, config: TrainConfig, context: RunContext, out: Any,
            checkpoints: RunCheckpoints | None, metrics: list[dict[str, Any]], tokenizer: Any, writer: bool,
            precision_name: str, reasons: list[str], *, resumed_from: int | None) -> TrainResult:
    """Closes the optimizer, writes the run folder's results (not after a signal: the checkpoint is the
    result then) and returns the ``TrainResult``."""
    seconds = time.perf_counter() - tally.start  # the whole session: evaluation, checkpoints and files included
    masters = s.optimizer.master_weights() if s.in_force.settings.optimizer == "offload-bf16-weights" else {}
    if hasattr(s.optimizer, "close"):  # CPUOffloadOptimizer: its gradient hooks and worker thread end with the run
        s.optimizer.close()
    if out is not None and not tally.stopped_by:
        sharded = is_fsdp2(s.model)
        if sharded:  # collective: model.safetensors one gathered tensor at a time, then what hf/ is written from
            write_gathered_weights(out / "model.safetensors" if writer else None, s.model, checkpoints,
                                   context.device)
            state = hf_weights(out / "model.safetensors", s.model, adapters=not config.merge_lora)
        else:
            state = model_state_dict(s.model)
        if writer:
            _write_results(out, checkpoints, s.model, None if sharded else state, masters, metrics, s.in_force,
                           s.plan_check, s.replans, context)
        export_results(out, s.model, state, tokenizer, seq_len=context.seq_len, sample_bytes=config.sample_bytes,
                       seed=config.seed, merge=config.merge_lora, writer=writer, checkpoints=checkpoints,
                       masters=masters, sample_context=s.precision.autocast)
    last = tally.last
    return TrainResult(
        steps=last.step, tokens=tally.tokens, seconds=seconds, final_loss=last.loss, eval_loss=tally.eval_loss,
        checkpointed_blocks=tuple(s.blocks), precision=precision_name, micro_batch_size=s.micro,
        accumulation=s.accumulation, activation_bytes=last.activation_bytes,
        model_state_bytes=last.model_state_bytes, peak_bytes=last.peak_bytes, skipped_steps=s.acc.skipped_steps,
        resumed_from=resumed_from, stopped_by=tally.stopped_by, out_dir=str(out) if out is not None else None,
        reasons=tuple(reasons), step_seconds=tally.step_seconds, plan=s.in_force.to_dict(), replans=len(s.replans),
        peak_reserved_bytes=last.peak_reserved_bytes,
    )


def _release_step(s: Session, device: torch.device) -> None:
    """Frees what a failed or finished step left (its partial gradients and window, a GradScaler's record of an
    unscale that no update followed, the allocator's cached blocks)."""
    s.optimizer.zero_grad(set_to_none=True)
    with contextlib.suppress(MemtrainError):  # not inside a micro-batch: its context has exited
        s.acc.discard_window()
    if s.precision.scaler is not None:
        # NOTE: GradScaler keeps "unscale_() already called" per optimizer until update(); a step that failed
        # between the two would make the retry's unscale_() raise. No public reset exists.
        s.precision.scaler._per_optimizer_states.clear()
    gc.collect()
    acc = accelerator(device)
    if acc.has_streams:
        acc.empty_cache()


def _write_results(out: Any, checkpoints: RunCheckpoints | None, model: nn.Module,
                   state: dict[str, torch.Tensor] | None, masters: dict[int, torch.Tensor],
                   metrics: list[dict[str, Any]], in_force: PlanInForce, plan_check: PlanCheck | None,
                   replans: list[dict[str, Any]], context: RunContext) -> None:
    """model.safetensors from ``state`` (fp32 masters where the device held bf16 copies; None: written already, as
    FSDP2's is), report.json with its plots (sample.txt and hf/ are export_results')."""
    if state is not None:
        duplicates = tied_duplicates(model)  # tied weights once, under their first name
        names = {id(p): n for n, p in model.named_parameters()}
        for pid, master in masters.items():
            if names.get(pid) in state:
                state[names[pid]] = master
        weights = {k: v for k, v in state.items() if k not in duplicates}
        with write_faults(out / "model.safetensors", checkpoints):
            save_weights_file(weights, out / "model.safetensors")
    with write_faults(out / "report.json", checkpoints):
        report = write_run_report(out, metrics, in_force, plan_check, replans, model, context.global_batch,
                                  context.seq_len, context.device, context.world)
    if report.get("without_memtrain_error"):
        _log(f"  report.json: no estimate of plain training ({report['without_memtrain_error']})")


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
