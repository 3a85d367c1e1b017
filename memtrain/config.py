"""A training run's settings (``TrainConfig``, checked whole by ``validate``) and its outcome (``TrainResult``).

``memtrain.train`` re-exports both; ``train()`` takes the one and returns the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from memtrain.choices import Choices
from memtrain.errors import ConfigError
from memtrain.message import arg
from memtrain.planner import budget_bytes
from memtrain.run.tensorboard import logger_problems

PrecisionChoice = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"]
LrScheduleChoice = Literal["cosine", "linear", "constant"]
LR_SCHEDULES: tuple[LrScheduleChoice, ...] = ("cosine", "linear", "constant")
MAX_SEED = 2**63  # seeds are torch.Generator seeds (64 bits), plus one per epoch of the data


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one training run needs besides the model and the data. Memory effects are noted per field."""

    max_steps: int | None = None  # optimizer steps; None: 500, or as many as ``epochs`` make (never both)
    epochs: int | None = None  # passes over the training data: max_steps = ceil(epochs x examples / global batch)
    # The memory budget: the plan (memtrain.planner) picks every choice left as None / "auto" below so that the
    # predicted peak fits it at the highest predicted tokens/s, and the run checks the plan at step 2.
    budget: int | str | None = None  # device bytes per rank ("24GiB"); None: what the device has free at the start
    host_budget: int | str | None = None  # host RAM the plan may use (offloads, pinned buffers); None: what is free
    safety_margin: float = 0.05  # of the budget, left for the allocator's fragmentation
    micro_batch_size: int | None = None  # examples per forward (activations grow with it); None: the plan's
    global_batch_size: int | None = None  # examples per optimizer step, all ranks; None: default_global_batch
    # (memtrain.choices): 16 x world size, or micro_batch_size x world size where that is given
    # The peak learning rate; None: 2e-5 fine-tuning a pretrained Hugging Face model, 2e-4 for LoRA adapters on
    # one, 3e-3 training from random weights (memtrain.schedule.default_lr, which cites the recipes).
    lr: float | None = None
    # Linear warm-up; None: 3% of max_steps (at least 1) fine-tuning, else min(50, max_steps // 10).
    warmup_steps: int | None = None
    lr_schedule: LrScheduleChoice = "cosine"  # after the warm-up: cosine or linear to lr * min_lr_ratio, or constant
    min_lr_ratio: float = 0.1  # the cosine and linear schedules decay to lr * min_lr_ratio at max_steps
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)  # AdamW's moment decays (beta1, beta2)
    adam_eps: float = 1e-8  # AdamW's denominator term
    grad_clip: float | None = 1.0  # the global gradient norm is clipped to this; None: not clipped
    precision: PrecisionChoice = "auto"  # 16-bit halves most activation bytes
    # The memory techniques (memtrain.choices.Choices): a None in them is the plan's to choose, a value is fixed and
    # the plan fits the rest around it. Their memory effects: checkpointing keeps only a recomputed block's input
    # (about one extra forward of it); offload_activations puts saved activations in pinned host memory (CUDA only);
    # optimizer=OptimizerChoice(placement="offload") moves fp32 master + AdamW state to host RAM (12 bytes/param off
    # the device), state_precision "bf16" / "int8" shrinks AdamW's moments (8 bytes/param to 4 / about 2),
    # step_in_backward frees each gradient as its parameter steps, offload_fraction puts that share of the state in
    # host RAM; chunked_loss computes the fp32 logits 1024 tokens at a time; compile fuses the step's kernels.
    choices: Choices = field(default_factory=Choices)
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
    # Where the run logs beside metrics.jsonl: "tensorboard" (event files in <run>/tensorboard/; the
    # memtrain[tensorboard] extra); quiet=True prints the plan in one line instead of each choice with its reason.
    log: tuple[str, ...] = ()
    quiet: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainConfig:
        # An unknown keyword is a ConfigError naming the fields and the one that holds the techniques (as
        # ``Choices.from_dict``'s), not a TypeError: a technique's own setting goes in ``choices=``.
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"TrainConfig: unknown {'field' if len(unknown) == 1 else 'fields'} {', '.join(unknown)}"
                              ". To resolve this error, use the fields TrainConfig has ("
                              f"{', '.join(f.name for f in fields(cls))}); the memory techniques (checkpointing, "
                              "offloads, the optimizer's placement and state, chunked loss, compile) are one field: "
                              "pass choices=Choices(...) (memtrain.Choices), e.g. "
                              "choices=Choices(checkpointing='every:2').")
        return super().__new__(cls)

    def validate(self) -> None:
        """Raises one ConfigError listing every bad field (each named as the argument, e.g. ``out_dir=``)."""
        ConfigError.raise_if([*self._length_problems(), *self._optimization_problems(), *self._memory_problems(),
                              *self._output_problems()])

    def _length_problems(self) -> list[str]:
        """The run's length and batches: steps or epochs, the batch sizes, how often it evaluates and saves."""
        problems = []
        for name in ("eval_every", "eval_batches"):
            value = getattr(self, name)
            if not _is_int(value, 1):
                problems.append(f"{arg(name, value)} must be an integer >= 1. To resolve this error, pass e.g. "
                                f"{arg(name, 1)}.")
        for name in ("max_steps", "epochs", "micro_batch_size", "global_batch_size", "save_every"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, 1):
                problems.append(f"{arg(name, value)} must be an integer >= 1, or unset. To resolve this error, pass "
                                f"e.g. {arg(name, 4)}, or leave it unset.")
        if self.max_steps is not None and self.epochs is not None:
            problems.append(f"{arg('max_steps', text=str(self.max_steps))} and "
                            f"{arg('epochs', text=str(self.epochs))} both set the run's length. To resolve this "
                            "error, pass one of them.")
        if self.micro_batch_size is not None and isinstance(self.global_batch_size, int) \
                and isinstance(self.micro_batch_size, int) and self.micro_batch_size > self.global_batch_size >= 1:
            problems.append(f"{arg('micro_batch_size', self.micro_batch_size)} is more than "
                            f"{arg('global_batch_size', self.global_batch_size)}. To resolve this error, pass a "
                            f"{arg('micro_batch_size')} that divides it, or leave {arg('micro_batch_size')} unset for "
                            "the plan to choose.")
        return problems

    def _optimization_problems(self) -> list[str]:
        """What is computed: the learning rate and its schedule, AdamW's hyper-parameters, clipping, the seed."""
        problems = []
        if self.lr is not None and not (_number(self.lr) and self.lr > 0):
            problems.append(f"{arg('lr', self.lr)} must be a positive number, or None for the default of the model. "
                            f"To resolve this error, pass e.g. {arg('lr', text='3e-3')}, or leave it unset.")
        if self.lr_schedule not in LR_SCHEDULES:
            problems.append(f"{arg('lr_schedule', self.lr_schedule)} is not one of cosine, linear, constant. To "
                            "resolve this error, pass one of them.")
        betas = self.adam_betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
            problems.append(f"{arg('adam_betas', betas)} must be two numbers in [0, 1) (beta1, beta2). To resolve this "
                            f"error, pass e.g. {arg('adam_betas', (0.9, 0.999))}.")
        if not (_number(self.adam_eps) and self.adam_eps > 0):
            problems.append(f"{arg('adam_eps', self.adam_eps)} must be a number > 0. To resolve this error, pass e.g. "
                            f"{arg('adam_eps', text='1e-8')}.")
        if self.warmup_steps is not None and not _is_int(self.warmup_steps, 0):
            problems.append(f"{arg('warmup_steps', self.warmup_steps)} must be an integer >= 0, or None for "
                            f"the default. To resolve this error, pass e.g. {arg('warmup_steps', 10)}, or leave it "
                            "unset.")
        elif (isinstance(self.warmup_steps, int) and isinstance(self.max_steps, int)
              and self.warmup_steps > self.max_steps >= 1):
            problems.append(f"{arg('warmup_steps', self.warmup_steps)} is more than "
                            f"{arg('max_steps', self.max_steps)}: the learning rate would never reach lr. To resolve "
                            "this error, pass "
                            f"{arg('warmup_steps', self.max_steps // 10)} or fewer, or leave it unset.")
        if not _is_int(self.seed, 0) or self.seed >= MAX_SEED:
            problems.append(f"{arg('seed', self.seed)} must be an integer in [0, 2**63). To resolve this error, pass "
                            f"e.g. {arg('seed', 0)}.")
        if not (_number(self.min_lr_ratio) and 0.0 <= self.min_lr_ratio <= 1.0):
            problems.append(f"min_lr_ratio={self.min_lr_ratio!r} must be a number in [0, 1]. To resolve this error, pass e.g. "
                            "min_lr_ratio=0.1.")
        if not (_number(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"{arg('weight_decay', self.weight_decay)} must be a number >= 0. To resolve this "
                            f"error, pass e.g. {arg('weight_decay', 0.1)}.")
        if self.grad_clip is not None and not (_number(self.grad_clip) and self.grad_clip > 0):
            problems.append(f"{arg('grad_clip', self.grad_clip)} must be a number > 0, or None for no clipping. To "
                            f"resolve this error, pass e.g. {arg('grad_clip', 1.0)}.")
        return problems

    def _memory_problems(self) -> list[str]:
        """What the plan fits: the budgets and their margin, the precision, the technique choices, FSDP."""
        problems = []
        for name in ("budget", "host_budget"):
            try:
                budget_bytes(getattr(self, name), name)
            except ConfigError as e:
                problems += e.problems
        if not (_number(self.safety_margin) and 0 <= self.safety_margin < 0.9):
            problems.append(f"safety_margin={self.safety_margin!r} must be a fraction in [0, 0.9). To resolve this error, "
                            "pass e.g. safety_margin=0.05.")
        if self.precision not in ("auto", "fp32", "bf16-mixed", "fp16-mixed"):
            problems.append(f"{arg('precision', self.precision)} is not one of auto, fp32, bf16-mixed, fp16-mixed. "
                            "To resolve this error, pass one of them.")
        if not isinstance(self.fsdp, bool):
            problems.append(f"fsdp={self.fsdp!r} must be True or False. To resolve this error, pass one of them.")
        if not isinstance(self.choices, Choices):
            problems.append(f"choices={self.choices!r} is not a Choices. To resolve this error, pass e.g. "
                            "choices=Choices(checkpointing='all'), or choices=Choices.from_dict({...}) for a mapping "
                            "(memtrain.choices).")
            return problems
        problems += self.choices.precision_problems(self.precision)
        if isinstance(self.fsdp, bool):
            try:
                self.choices.check_run(fsdp=self.fsdp)
            except ConfigError as e:
                problems += e.problems
        return problems

    def _output_problems(self) -> list[str]:
        """What the run writes and shows: the run folder (overwrite, resume, merged weights), the sample, logs."""
        problems = []
        for name in ("overwrite", "resume", "progress", "merge_lora", "quiet"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be True or False. To resolve this error, pass one of them.")
        if self.overwrite is True and self.resume is True:
            problems.append(f"{arg('overwrite', True)} and {arg('resume', True)} contradict each other. To resolve "
                            f"this error, pass {arg('resume', True)} to continue the run in {arg('out_dir')}, or "
                            f"{arg('overwrite', True)} to start it again.")
        if (self.overwrite is True or self.resume is True) and not self.out_dir:
            problems.append(f"{arg('overwrite', True)} and {arg('resume', True)} need a run folder. To resolve this "
                            f"error, pass {arg('out_dir', 'DIR')}.")
        if self.merge_lora is True and not self.out_dir:
            problems.append(f"{arg('merge_lora', True)} writes the merged weights into the run folder's hf/. To "
                            f"resolve this error, pass {arg('out_dir', 'DIR')}.")
        if not _is_int(self.sample_bytes, 0):
            problems.append(f"sample_bytes={self.sample_bytes!r} must be an integer >= 0. To resolve this error, pass "
                            "e.g. sample_bytes=240, or 0 for no sample.")
        return problems + logger_problems(self.log)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (``choices`` as ``Choices.to_dict``): a run folder's config.json."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["choices"] = self.choices.to_dict()
        return out


def _number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object, minimum: int) -> bool:
    """An int (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass(frozen=True, kw_only=True)
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
    plan: dict[str, Any] | None = None  # the plan at the end: its settings and predictions (PlanInForce.to_dict())
    replans: int = 0  # plans made again because the device disagreed (a peak over the budget, out of memory)
    # The allocator's reserved peak over the last step, its cache included: what runs out (None on the CPU)
    peak_reserved_bytes: int | None = None
