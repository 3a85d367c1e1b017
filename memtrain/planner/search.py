"""plan(): one byte budget in, the fastest training set-up that fits out, with a reason for every choice.

The search is over the choices memtrain's techniques give a training step: the micro-batch (and so the
accumulation), each block kept, recomputed (fully or selectively, its inputs optionally in host memory) or
offloaded, the loss whole or chunked, the optimizer on the device or on the CPU (with fp32 or bf16 device
weights), DDP or FSDP2, eager or compiled. It runs in three steps:

1. Profile. The step is traced on fake tensors (``memtrain.estimate.trace``) with every block of one kind, at
   two micro-batch sizes; each trace records, per block and phase, the bytes alive, the bytes saved and the work
   done (FLOPs, memory traffic, operator calls). A handful of traces, whatever the number of candidates.
2. Compose. Every candidate's peak is rebuilt from those per-block figures (forward, the head and loss, backward
   block by block, the optimizer step), its host bytes from the offloaded bytes and the optimizer state, and its
   step time from a cost model whose device figures come from a calibration probe or a table of known GPUs.
   Every layout of one set-up is composed at once (numpy over the rows), and the set-ups that differ only in the
   optimizer share their blocks' figures (``cost.Layout``): the 70B's 1.8 million candidates compose in under 2 s
   of CPU.
3. Choose. The fastest candidate whose peak fits the budget less a safety margin, and whose host bytes fit the
   host, is confirmed by a full ``estimate`` of exactly that set-up; should the estimate disagree, the next one
   is tried.

``apply_plan(model, plan)`` then calls the public primitives in order, and ``train`` is plan -> apply -> loop.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memtrain import techniques
from memtrain.checkpointing import find_blocks
from memtrain.choices import Choices
from memtrain.device import accelerator
from memtrain.errors import ConfigError
from memtrain.estimate import Trace, meta_model, trace
from memtrain.estimate.arguments import check_against_model
from memtrain.estimate.fake import batch_spec
from memtrain.loss import supports_chunked_loss
from memtrain.measure import available_host_bytes
from memtrain.optim import INT8_DEVICES
from memtrain.planner.checks import (
    check_choices,
    check_fixed,
    check_plan_arguments,
    check_settings,
    divisors,
    setup_of,
)
from memtrain.planner.cost import (
    CandidateTable,
    Composer,
    FullEstimates,
    gradient_shard,
    rank_peak,
)
from memtrain.planner.devices import DeviceProfile, device_profile
from memtrain.planner.hint import FSDP2Fit, fsdp2_fit, hint_lines, pure_bf16_candidate, size_hints
from memtrain.planner.profiles import Profiles
from memtrain.planner.reasons import (
    plan_assumptions,
    plan_reasons,
    raise_nothing_fits,
    refused_row,
    runners_up,
)
from memtrain.planner.settings import (
    DEFAULT_SAFETY_MARGIN,
    Candidate,
    Configuration,
    Fixed,
    Plan,
    PlanSettings,
    Problem,
    configuration_of,
)
from memtrain.planner.tracing import build_profiles, step_batch
from memtrain.quantize import fsdp_shards_4bit, is_quantized, weight_count
from memtrain.report import format_bytes
from memtrain.techniques import refuses
from memtrain.techniques.optimizer.cost import profile_key, space_profiles
from memtrain.techniques.view import SearchSpace
from memtrain.tiled_mlp import mlp_width

_VERIFY_LIMIT = 16  # full estimates tried, fastest first, before giving up on the composed ranking
_VERIFY_BAND = 0.03  # candidates composed up to this much over the usable budget are estimated in full too,
_NEAR_MISSES = 3  # at most this many of them
_FSDP2_ESTIMATES = 12  # full estimates a refusal's FSDP2 hint may make, over every rank count it judges
_FSDP2_TRIES = 1  # the fastest rows the hint estimates in full at each rank count it judges (then the least row)
# A line per slow stage (each traced kind of step, each full estimate): a large model plans for minutes, and a
# command shows it is working (memtrain plan prints these on stderr). Silent unless a handler is attached.
PROGRESS = logging.getLogger("memtrain.planner.progress")


def plan(
    model_or_hf_config: Any,
    *,
    budget: int | str | None,
    seq_len: int,
    global_batch_size: int,
    device: str = "cuda",
    precision: str = "bf16-mixed",
    precision_reason: str | None = None,
    world_size: int = 1,
    fsdp: bool | None = False,
    host_budget: int | str | None = None,
    compile: bool = False,
    micro_batch_size: int | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    grad_clip: bool = True,
    techniques: Iterable[str] | None = None,
    device_profile: DeviceProfile | None = None,
    settings: PlanSettings | None = None,
    choices: Choices | None = None,
    correction_bytes: int = 0,
    keep_optimizer: PlanSettings | None = None,
    packed: bool = False,
    kept_share: float = 1.0,
) -> Plan:
    """The fastest set-up whose predicted peak fits ``budget`` (per rank), with a reason for each choice.

    Pure: nothing is allocated on a device and the model is not modified (it may live on the meta device, or be
    a Hugging Face config). A 1.1B Llama plans in a few seconds (``memtrain plan``'s output says how long).

    Args:
        model_or_hf_config: an ``nn.Module`` (any device) or a Hugging Face ``PretrainedConfig``.
        budget: device bytes per rank (an int, or a size such as ``"24GiB"``); None for no limit.
        seq_len: tokens per example.
        global_batch_size: examples per optimizer step, over all ranks.
        device: ``"cuda"`` or ``"cpu"`` (a CPU plan leaves out activation and optimizer offload, which would only
            copy within RAM).
        precision: ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"`` (compute; weights stay fp32 unless the plan
            puts bf16 weights on the device with an offloaded fp32 master).
        precision_reason: why ``precision`` (``resolve_precision``'s: "fp32, because: ..."); None: requested.
        world_size: ranks; the global batch is split over them.
        fsdp: True plans FSDP2, False DDP, None both (the reasons say which fits faster). Ignored for one rank.
        host_budget: host RAM the plan may use (one node, all ranks); None: the RAM available now.
        compile: also consider ``torch.compile``d set-ups (``choices.compile``: only those).
        micro_batch_size: fix the micro-batch (the plan chooses the rest); None chooses it too.
        safety_margin: the fraction of ``budget`` left free for the allocator's fragmentation.
        grad_clip: the run clips gradients (the offloaded optimizer then steps after backward).
        techniques: allow only some of ``TECHNIQUES``; None allows all.
        device_profile: the device's rates; None probes the CPU, or takes the table of known GPUs for CUDA.
        settings: no search: predict exactly this set-up (e.g. one chosen by hand), which must fit ``budget``.
        choices: the technique choices the search keeps as given (a ``Choices``: a checkpointing layout, the loss,
            the optimizer's placement and state; its None fields are the plan's), translated by
            ``Fixed.of_choices``: a choice that does nothing on ``device`` is dropped with a reason saying so.
            Not applied with ``settings``. ``pure_bf16``: see ``memtrain.planner.hint``.
        correction_bytes: added to every predicted peak: what a measurement showed the prediction missed (a
            re-plan after the device disagreed).
        keep_optimizer: a plan's settings whose optimizer (placement, moments, step in backward, offloaded share)
            the search keeps, whatever ``choices`` say (a resume or re-plan: the optimizer's state exists).
        packed: the batches are packed rows (``memtrain.data.PackedRows``: several documents a row): the steps are
            traced with their labels and restarting ``position_ids``, from which a Hugging Face model builds a
            block-diagonal attention mask (more saved bytes than a causal one).
        kept_share: the share of label positions the loss counts (not -100), e.g. 0.5 where half of each row is a
            prompt. The chunked loss runs the head on those alone, so the loss's time follows it; the peak does not
            (it holds a batch whose every label counts).

    Returns:
        A ``Plan``: ``.settings`` for ``apply_plan``, the predictions, the reasons and the runners-up.

    Raises:
        ConfigError: a bad argument (every problem at once), or nothing fits: the error says which budget is
            short (device or host RAM) and by how much, and names a budget or option that would fit.

    Example:
        >>> from memtrain.models import GPT, GPT_PRESETS
        >>> p = plan(GPT(GPT_PRESETS["gpt-tiny"]), budget=None, seq_len=64, global_batch_size=8, device="cpu")
        >>> p.settings.checkpointing, p.settings.micro_batch_size  # no limit: nothing recomputed, one forward
        ('none', 8)
    """
    started = time.perf_counter()
    (budget_bytes, host_budget_bytes, allowed, per_rank), choices, problems = _checked_arguments(
        dict(budget=budget, host_budget=host_budget, seq_len=seq_len, global_batch_size=global_batch_size,
             world_size=world_size, micro_batch_size=micro_batch_size, device=device, precision=precision,
             safety_margin=safety_margin, techniques=techniques, kept_share=kept_share), choices, fsdp)
    ctx = problem_of(model_or_hf_config, seq_len, global_batch_size, device,
                     settings.precision if settings is not None else precision, world_size,
                     "chunked-loss" in allowed, grad_clip, device_profile, packed, precision_reason, kept_share)
    fixed, allowed, notes = _constraints(ctx, choices, allowed, settings, keep_optimizer)
    ConfigError.raise_if(problems + _model_problems(ctx, budget_bytes, fixed, settings, per_rank))
    composer, results, pure, wider = _candidates(ctx, fixed, allowed, settings, per_rank, fsdp, micro_batch_size,
                                                 compile or choices.compile, correction_bytes)
    return _choose(ctx, composer, results, budget_bytes, host_budget_bytes, safety_margin, started,
                   correction_bytes, pure, notes, wider)


def _candidates(ctx: Problem, fixed: Fixed, allowed: set[str], settings: PlanSettings | None, per_rank: int,
                fsdp: bool | None, micro_batch_size: int | None, compile: bool,
                correction_bytes: int
                ) -> tuple[Composer, CandidateTable, Callable[..., Any], Callable[[int], Any] | None]:
    """Every candidate of the search space (or ``settings`` alone) composed into one ranked table, each peak with
    ``correction_bytes`` added; with the composer, the pure bf16 hint's search (``_search``) and the FSDP2 hint's
    candidates (``_fsdp2_candidates`` less the ranks; None with ``settings``: nothing was searched)."""
    space = _search_space(ctx, allowed, fsdp, fixed, compile)
    results = CandidateTable(len(ctx.block_names))
    composer = _composer(ctx, space, results, settings)
    micros = [micro_batch_size] if micro_batch_size is not None else divisors(per_rank)
    pure = _search(composer, results, space, fixed, micros, per_rank)
    if results.empty:  # the fixed choices rule out every set-up
        raise ConfigError(techniques.optimizer.TECHNIQUE.unbuildable(fixed, micro_batch_size, ctx.world, fsdp))
    results.finish()
    results.peak = results.peak + correction_bytes
    wider = None if settings is not None else functools.partial(
        _fsdp2_candidates, composer, allowed, fixed, compile, micros, per_rank, correction_bytes)
    return composer, results, pure, wider


def _fsdp2_candidates(composer: Composer, allowed: set[str], fixed: Fixed, compile: bool, micros: Sequence[int],
                      per_rank: int, correction_bytes: int, ranks: int) -> tuple[Composer, CandidateTable] | None:
    """Every FSDP2 set-up of the plan's space over ``ranks`` ranks, each rank taking the examples it takes now
    (``memtrain plan --nproc N``'s default global batch), composed from the plan's profiles (``correction_bytes``
    added), with their composer: the refusal's FSDP2 hint. None where the fixed choices take no FSDP2 (an optimizer
    FSDP2 cannot shard, pure bf16) or it needs profiles the plan did not trace."""
    ctx = dataclasses.replace(composer.ctx, world=ranks, global_batch=per_rank * ranks)
    space = _search_space(ctx, allowed, True, fixed, compile)
    space.distributions = [d for d in space.distributions if d == "fsdp2"]
    if (not space.distributions or not set(space_profiles(space)) <= composer.profiles.keys()
            or (is_quantized(ctx.model) and not fsdp_shards_4bit())):  # this torch's FSDP2: no packed 4-bit codes
        return None
    table, wide = CandidateTable(len(ctx.block_names)), Composer(ctx, composer.profiles)
    PROGRESS.info(f"plan: the plan over {ranks} GPUs with FSDP2, for the refusal's fix")
    _search(wide, table, space, fixed, micros, per_rank, say=False)
    if table.empty:
        return None
    table.finish()
    table.peak = table.peak + correction_bytes
    return wide, table


def _host_limit(device: str, host_budget_bytes: int | None) -> int | None:
    """The host RAM to check against: the budget given, or this machine's when the plan is for this machine."""
    here = device == "cpu" or accelerator().has_streams  # an accelerator here (a simulated one: this host)
    return host_budget_bytes if host_budget_bytes is not None else (available_host_bytes() if here else None)


def _setup_line(s: PlanSettings) -> str:
    return (f"micro-batch {s.micro_batch_size}, checkpointing {s.checkpointing}, optimizer {s.optimizer_text}"
            + (", compiled" if s.compile else ""))


def _composer(ctx: Problem, space: SearchSpace, results: CandidateTable,
              settings: PlanSettings | None) -> Composer:
    """The composer for ``plan``: of the space's kinds; or, with ``settings``, of theirs, added to ``results`` (and
    nothing left to search)."""
    if settings is not None:  # checked by plan (_model_problems)
        composer = composer_for(ctx, [settings])
        _add_given(composer, results, settings)
        space.placements = []  # nothing to search
        return composer
    profiles: dict[Any, Profiles] = {}
    weights = space_profiles(space)
    for i, dtype in enumerate(weights, 1):
        PROGRESS.info(f"plan: tracing a step of each kind of block at micro-batches 1 and 2 ({dtype or 'fp32'} "
                      f"weights on the device, {i} of {len(weights)})")
        profiles[dtype] = build_profiles(ctx, space.flavors, space.offload_blocks, dtype, tiled=True in space.tiled)
    return Composer(ctx, profiles)


def _check_a_block_fits(ctx: Problem, budget_bytes: int | None) -> None:
    """ConfigError for a budget below the largest block's parameters: no set-up computes a block in it."""
    modules = dict(ctx.model.named_modules())
    largest_block = max(sum(p.numel() * p.element_size() for p in modules[b].parameters()) for b in ctx.block_names)
    if budget_bytes is not None and budget_bytes < largest_block:
        raise ConfigError(f"budget {format_bytes(budget_bytes)} is smaller than one block's parameters "
                          f"({format_bytes(largest_block)}): no set-up computes a block in it. To resolve this error, "
                          "pass a larger budget (e.g. the GPU's memory), or shard the model over more GPUs (FSDP2).")


def _checked_arguments(arguments: dict[str, Any], choices: Any,
                       fsdp: bool | None) -> tuple[tuple[int | None, int | None, set[str], int], Choices, list[str]]:
    """``plan``'s arguments checked (``check_plan_arguments``: the budgets in bytes, the techniques allowed, the
    examples per rank), its choices (``check_choices``), and their problems, to be raised with the model's (every
    problem known before tracing at once). Raises them at once where the arguments are wrong: the model is not
    built from those."""
    problems: list[str] = []
    checked = ConfigError.gathered(problems, lambda: check_plan_arguments(**arguments))
    world = arguments["world_size"]
    choices = ConfigError.gathered(problems, lambda: check_choices(
        choices, world_size=world if isinstance(world, int) else 1, fsdp=fsdp)) or Choices()
    if checked is None:
        raise ConfigError(problems)
    return checked, choices, problems


def _constraints(ctx: Problem, choices: Choices, allowed: set[str], settings: PlanSettings | None,
                 keep_optimizer: PlanSettings | None) -> tuple[Fixed, set[str], list[str]]:
    """The fixed choices, the techniques allowed and the notes for ``plan``: the choices' (none with ``settings``),
    with ``keep_optimizer``'s optimizer."""
    fixed, notes = Fixed(), []
    if settings is None:
        fixed, can_use, notes = Fixed.of_choices(choices, n_blocks=len(ctx.block_names), device=ctx.device)
        allowed = allowed & can_use
    if keep_optimizer is not None:  # what its state depends on, each technique's part (Technique.kept)
        fixed = dataclasses.replace(fixed, **{k: v for t in techniques.REGISTRY for k, v in t.kept(keep_optimizer).items()})
    return fixed, allowed, notes


def _model_problems(ctx: Problem, budget_bytes: int | None, fixed: Fixed, settings: PlanSettings | None,
                    per_rank: int) -> list[str]:
    """What the model cannot take, every problem at once: a budget below one block, fixed choices or ``settings``
    it cannot take, a sequence longer than its positions."""
    problems: list[str] = []
    n_blocks, cuda, spec = len(ctx.block_names), ctx.device == "cuda", batch_spec(step_batch(ctx, 1), None, None, [])
    ConfigError.gathered(problems, lambda: _check_a_block_fits(ctx, budget_bytes))
    if fixed != Fixed():
        ConfigError.gathered(problems, lambda: check_fixed(fixed, n_blocks, cuda, ctx.chunkable, ctx.precision))
    if settings is not None:
        ConfigError.gathered(problems, lambda: check_settings(settings, n_blocks, per_rank, cuda, ctx.world,
                                                              ctx.chunkable, ctx.precision))
    if spec is not None:
        ConfigError.gathered(problems, lambda: check_against_model(ctx.model, spec, False))
    return problems


def _search_space(ctx: Problem, allowed: set[str], fsdp: bool | None, fixed: Fixed, compile: bool) -> SearchSpace:
    """The recompute flavors, block offload, the optimizer's placements, moment precisions, steps and host shares,
    distributions, losses, parameter offload and compile allowed (``compile``: the run compiles, so compiled set-ups
    are weighed too): each technique's candidates, then each narrowed to the fixed choices."""
    space = SearchSpace()
    problem = _SearchProblem(ctx, fsdp, compile)
    for technique in techniques.REGISTRY:
        technique.candidates(space, problem, frozenset(allowed))
    for technique in techniques.REGISTRY:
        technique.narrow(space, fixed)
    return space


class _SearchProblem:
    """What the techniques' candidates depend on (``techniques.SearchProblem``); the costlier answers found once,
    where a technique asks."""

    def __init__(self, ctx: Problem, fsdp: bool | None, compile: bool) -> None:
        self._ctx = ctx
        self.cuda, self.precision, self.world, self.fsdp = ctx.device == "cuda", ctx.precision, ctx.world, fsdp
        self.chunkable, self.compile = ctx.chunkable, compile

    @functools.cached_property
    def blocks_all_train(self) -> bool:
        return _blocks_all_train(self._ctx)

    @functools.cached_property
    def int8(self) -> bool:
        return _int8_runs(self._ctx.device)

    @functools.cached_property
    def mlp_tiles(self) -> int:
        width = mlp_width(self._ctx.model)
        return self._ctx.seq_len // width if width else 0


def _blocks_all_train(ctx: Problem) -> bool:
    modules = dict(ctx.model.named_modules())
    return all(p.requires_grad for name in ctx.block_names for p in modules[name].parameters())


def _search(composer: Composer, results: CandidateTable, space: SearchSpace, fixed: Fixed, micros: Sequence[int],
            per_rank: int, *, say: bool = True) -> Callable[..., Any]:
    """Composes every candidate of the space into ``results``: for each configuration, every count of offloaded
    and recomputed blocks (or the fixed layout). Returns the search of the pure bf16 set-ups for a hint,
    ``(host limit, usable, faster than, correction) -> PureBF16Hint | None``: pure bf16 changes the numerics, so
    it is never chosen unless asked for (``memtrain.planner.hint``)."""
    ctx = composer.ctx
    L, flavors = len(ctx.block_names), space.flavors
    run = _SearchRun(micros=micros, per_rank=per_rank)
    configurations = _configurations(space, fixed, run, ctx.world, ctx.precision)
    jobs: list[tuple[Configuration, np.ndarray, np.ndarray]] = []  # composed together, added in this order
    for cfg in configurations:
        if fixed.blocks is not None:
            _add_given(composer, results, cfg.with_blocks(fixed.blocks), explicit=False)
            continue
        offload, recompute = _layouts(L, space.offload_blocks, bool(flavors), cfg.flavor == (flavors or ["full"])[0])
        if len(recompute):
            jobs.append((cfg, offload, recompute))
    if jobs and say:  # (``say``: on the progress line)
        PROGRESS.info(f"plan: composing {sum(len(r) for _, _, r in jobs):,} candidates"
                      f"{' in pure bf16' if space.pure_bf16 else ''} ({len(jobs)} set-ups over {len(micros)} "
                      "micro-batch sizes)")
    for (cfg, offload, recompute), figures in zip(jobs, composer.compose(jobs), strict=True):
        results.add(cfg, offload, recompute, *figures)

    def pure(limit: int | None, usable: int | None, faster_than: float | None, correction_bytes: int,
             margin: float | None = None) -> Any:
        return pure_bf16_candidate(composer, space, fixed, micros, per_rank, limit, usable,
                                   faster_than, correction_bytes, search=_search, estimate=estimate_of, margin=margin)
    return pure


@dataclass(frozen=True, kw_only=True)
class _SearchRun:
    """One pass of the search over a space (``techniques.SearchRun``)."""

    micros: Sequence[int]
    per_rank: int


def _configurations(space: SearchSpace, fixed: Fixed, run: _SearchRun, world: int,
                    precision: str) -> list[Configuration]:
    """The cross product of every technique's values in the space (``Technique.axis``, in
    ``techniques.SEARCH_ORDER``), less what a rule refuses and what a technique skips (``Technique.skips``)."""
    ordered = techniques.SEARCH_ORDER
    axes = [technique.axis(space, fixed, run) for technique in ordered]
    keys = [k for axis in axes for k in (axis[0] if axis else {})]
    assert len(keys) == len(set(keys)), f"two techniques' axes give one field: {keys}"
    out = []
    for values in itertools.product(*axes):
        cfg = Configuration(precision=precision, **{k: v for part in values for k, v in part.items()})
        if not (refuses(setup_of(cfg, world, precision))
                or any(technique.skips(cfg, fixed, run) for technique in ordered)):
            out.append(cfg)
    return out


@functools.lru_cache(maxsize=64)
def _layouts(n_blocks: int, offload_blocks: bool, recomputes: bool, first_flavor: bool) -> tuple[np.ndarray, ...]:
    """(offloaded, recomputed) block counts of every layout the search composes for one configuration, ordered by
    offloaded count, then recomputed count. Without recomputed blocks every flavor is the same set-up: only the
    first flavor has those rows."""
    pairs = [(o, r) for o in (range(n_blocks + 1) if offload_blocks else [0])
             for r in range(0 if first_flavor else 1, (n_blocks - o + 1) if recomputes else 1)]
    offload, recompute = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
    offload.flags.writeable = recompute.flags.writeable = False  # shared by every configuration (cached)
    return offload, recompute


def _int8_runs(device: str) -> bool:
    """Whether bitsandbytes' 8-bit AdamW is installed (the lowbit extra) and has kernels for ``device``.

    NOTE: found, not imported: importing bitsandbytes takes seconds (it loads torch.compile's machinery), which a
    plan that never picks int8 moments should not pay; apply_plan imports it when it does.
    """


    return device in INT8_DEVICES and importlib.util.find_spec("bitsandbytes") is not None


def problem_of(model_or_hf_config: Any, seq_len: int, global_batch_size: int, device: str, precision: str,
             world_size: int, chunk_allowed: bool, grad_clip: bool, device_profile_: DeviceProfile | None,
             packed: bool = False, precision_reason: str | None = None, kept_share: float = 1.0) -> Problem:
    meta = meta_model(model_or_hf_config)
    blocks = tuple(find_blocks(meta))
    if not blocks:
        raise ConfigError(f"plan: no repeated blocks found in {type(meta).__name__}, so nothing can be checkpointed "
                          "or offloaded block by block. To resolve this error, plan a model with an nn.ModuleList "
                          "of blocks (or Hugging Face _no_split_modules), or choose the techniques yourself.")
    dev = device_profile_ if device_profile_ is not None else device_profile(device)
    return Problem(model=meta, seq_len=seq_len, global_batch=global_batch_size, world=world_size, device=device,
                    precision=precision, device_profile=dev, block_names=blocks,
                    chunkable=chunk_allowed and supports_chunked_loss(meta), grad_clip=grad_clip, packed=packed,
                    precision_reason=precision_reason, kept_share=float(kept_share))


def composer_for(ctx: Problem, given: Sequence[PlanSettings]) -> Composer:
    """Profiles of just the kinds the given set-ups use."""
    flavors = sorted({s.flavor for s in given if "recompute" in s.blocks})
    offload = any("offload" in s.blocks for s in given)
    profiles: dict[Any, Profiles] = {}
    for dtype in (None, "bf16"):  # the device weights' dtypes of the set-ups (optimizer.cost.profile_key)
        if any(profile_key(s) == dtype for s in given):
            profiles[dtype] = build_profiles(ctx, flavors, offload, dtype, tiled=any(s.tiled_mlp for s in given))
    return Composer(ctx, profiles)


def _add_given(composer: Composer, results: CandidateTable, s: PlanSettings, *, explicit: bool = True) -> None:
    """One candidate with its own block layout; ``explicit``: it was given whole (nothing was searched)."""
    cfg = configuration_of(s)
    kinds = np.array(s.blocks)[None, :]
    results.add_settings(cfg, s, *composer.assigned(cfg, kinds == "offload", kinds == "recompute"))
    results.searched |= not explicit


def predictions(model_or_hf_config: Any, given: Sequence[PlanSettings], *, seq_len: int, global_batch_size: int,
                device: str = "cuda", world_size: int = 1, grad_clip: bool = True,
                device_profile: DeviceProfile | None = None) -> list[Candidate]:
    """The peak, host bytes and step time the planner predicts for each given set-up, composed from one set of
    profiles (no search, no full estimates): what it ranks candidates by. ``benchmarks/bench_plan.py`` sets them
    beside measured step times.

    Raises:
        ConfigError: set-ups of different precisions, or one the model or device cannot take.
    """
    precisions = {s.precision for s in given}
    if len(precisions) != 1:
        raise ConfigError(f"predictions: the set-ups have precisions {sorted(precisions)}; one profile serves one. "
                          "To resolve this error, ask for one precision at a time.")
    ctx = problem_of(model_or_hf_config, seq_len, global_batch_size, device, precisions.pop(), world_size, True,
                   grad_clip, device_profile)
    per_rank = global_batch_size // world_size
    for s in given:
        check_settings(s, len(ctx.block_names), per_rank, device == "cuda", world_size, ctx.chunkable, s.precision)
    composer = composer_for(ctx, given)
    results = CandidateTable(len(ctx.block_names))
    for s in given:
        _add_given(composer, results, s)
    results.finish()
    tokens = global_batch_size * seq_len
    return [Candidate(results.settings(k), int(results.peak[k]), int(results.host[k]), float(results.seconds[k]),
                      tokens / float(results.seconds[k]), False, host_link=composer.host_link(results.settings(k)))
            for k in range(len(given))]


def estimate_of(ctx: Problem, prof: Profiles, s: PlanSettings) -> tuple[float, Trace]:
    """A full estimate of exactly this set-up (one process, then the distributed shift): the peak and the trace.
    Each technique's part of the set-up is its own (``techniques.planned_options``)."""
    t = trace(ctx.model, step_batch(ctx, s.micro_batch_size), device=ctx.device, precision=ctx.precision,
              runs=gradient_shard(ctx, s) > 0,  # runs: when sharded gradients matter
              **techniques.planned_options(s, ctx.block_names))
    return rank_peak(ctx, prof, s, t), t


def _choose(ctx: Problem, composer: Composer, results: CandidateTable, budget_bytes: int | None,
            host_budget: int | None, margin: float, started: float, correction_bytes: int = 0,
            pure: Any = None, notes: Sequence[str] = (),
            wider: Callable[[int], tuple[Composer, CandidateTable] | None] | None = None) -> Plan:
    """The fastest row that fits the budget less ``margin`` and the host RAM, confirmed by a full estimate (the
    next is tried when the estimate disagrees), as a ``Plan`` with its reasons (``notes`` first), runners-up and
    assumptions; ``wider``: the FSDP2 candidates of a refusal's hint (``_fsdp2_candidates``)."""
    host_limit = _host_limit(ctx.device, host_budget)
    usable = None if budget_bytes is None else int(budget_bytes * (1 - margin))
    on_budget = None if usable is None else margin  # the margin where there is a budget
    chosen, estimates, fits_host = _judged(results, usable, host_limit, margin,
                                           _plan_estimate(ctx, composer, correction_bytes))
    faster_than = None if chosen is None else float(results.seconds[chosen])
    hint = pure(host_limit, usable, faster_than, correction_bytes, on_budget) if pure is not None else None
    if chosen is None:
        fsdp2 = None
        if wider is not None and usable is not None and ctx.device == "cuda":
            fsdp2 = functools.partial(_fsdp2_hint, ctx, results, wider, usable, host_limit, margin, correction_bytes,
                                      estimates.overshoot(correction_bytes))
        raise_nothing_fits(ctx, composer, results, estimates, budget_bytes, usable, host_limit, host_budget, margin,
                            fits_host, [hint.fix] if hint is not None else [], fsdp2)
    s = results.settings(chosen)
    peak, t = estimates[chosen]
    tokens_per_step = ctx.global_batch * ctx.seq_len
    seconds = float(results.seconds[chosen])
    # Every row judged as the search judges it: a composed one with what the full estimates showed.
    judged = estimates.fitting_all()
    fits_verified = fits_host & (judged <= usable) if usable is not None else fits_host
    return Plan(
        settings=s, budget_bytes=budget_bytes, usable_bytes=usable, host_budget_bytes=host_budget,
        peak_bytes=int(peak), host_bytes=int(results.host[chosen]), activation_bytes=t.report.activation_bytes,
        step_seconds=seconds, tokens_per_s=tokens_per_step / seconds, precision=ctx.precision, device=ctx.device,
        seq_len=ctx.seq_len, global_batch_size=ctx.global_batch, world_size=ctx.world, block_names=ctx.block_names,
        parameters=weight_count(ctx.model),  # a 4-bit layer's weights as weights, not its packed bytes
        reasons=(*notes, *plan_reasons(ctx, results, chosen, peak, estimates, judged, fits_host, usable, host_limit),
                 *hint_lines(hint, seconds), *size_hints(ctx, seconds)),
        candidates=tuple(runners_up(ctx, composer, results, chosen, estimates, fits_verified, fits_host, usable,
                                     host_limit)),
        assumptions=tuple(plan_assumptions(ctx, margin, composer, host_limit) + (
            [f"every predicted peak includes {format_bytes(correction_bytes)} that a measurement on this device "
             "showed the estimate missing"] if correction_bytes else [])), device_profile=ctx.device_profile, report=t.report,
        plan_seconds=time.perf_counter() - started, host_link=composer.host_link(s),
    )


def _fsdp2_hint(ctx: Problem, results: CandidateTable,
                wider: Callable[[int], tuple[Composer, CandidateTable] | None], usable: int, host_limit: int | None,
                margin: float, correction_bytes: int, overshoot: float = 0.0) -> FSDP2Fit | None:
    """The refusal's FSDP2 fix (``fsdp2_fit``): from the ranks the plan has (where it did not weigh FSDP2 there),
    else one more, the fewest where a set-up fits as the plan over them would find it (``_judged``, its fastest
    ``_FSDP2_TRIES`` rows, then its least row), and there the set-up that plan chooses; on at most
    ``_FSDP2_ESTIMATES`` full estimates in all (a one-process trace is the same at any rank count: each set-up is
    traced once). While it looks for a count that fits, one where no row composes within the search's band over the
    usable bytes is passed over untraced; the counts below the one found are then judged in full. Where none is
    found, and the plan's full estimates showed composition erring high (``overshoot``), the search looks again
    with the band widened by that much. None where the
    estimates run out before the plan over a count chose a set-up: the fewer tries can pass a count the plan
    refuses."""
    start = max(2, ctx.world + int((results.column("distribution") == "fsdp2").any()))
    if wider(start) is None:
        return None
    traces: dict[PlanSettings, Trace] = {}
    refused: set[int] = set()  # counts judged in full where the plan over them finds no set-up

    # A count judged again (a wide table can take hundreds of MB): the walk down's last, then the set-up named there,
    # mostly; one evicted is composed again.
    @functools.lru_cache(maxsize=2)
    def at(ranks: int) -> tuple[Composer, CandidateTable]:
        candidates = wider(ranks)
        assert candidates is not None  # the space's rules do not change with the rank count
        return candidates

    def judged(ranks: int, tries: int, over: float | None = None) -> FSDP2Fit | None:
        """The plan over ``ranks`` (``_judged`` with ``tries``); ``over``: None untraced where no row within the host
        RAM composes within that many bytes over the usable ones."""
        wide, table = at(ranks)
        fits_host = _fits_host(table, host_limit)
        if not fits_host.any() or (over is not None and table.peak[fits_host].min() > usable + over):
            return None

        def estimate(s: PlanSettings, which: str) -> tuple[float, Trace]:
            prof = wide.profile_of(s)
            if s not in traces:
                if len(traces) >= _FSDP2_ESTIMATES:
                    raise _EstimatesSpent
                PROGRESS.info(f"plan: a full estimate for FSDP2 over {ranks} GPUs ({_setup_line(s)})")
                traces[s] = estimate_of(wide.ctx, prof, s)[1]
            return rank_peak(wide.ctx, prof, s, traces[s]) + correction_bytes, traces[s]

        k, estimates, _ = _judged(table, usable, host_limit, margin, estimate, tries)
        if k is None:
            refused.add(ranks)
            return None
        return FSDP2Fit(ranks, table.settings(k), estimates.peak(k), float(table.host[k]))

    try:
        band = usable * _VERIFY_BAND
        looser = functools.partial(judged, tries=_FSDP2_TRIES, over=band + overshoot) if overshoot > 0 else None
        return fsdp2_fit(functools.partial(judged, tries=_FSDP2_TRIES, over=band),
                         functools.partial(judged, tries=_FSDP2_TRIES),
                         functools.partial(judged, tries=_VERIFY_LIMIT), start, refused, looser)
    except _EstimatesSpent:  # before the plan over a count chose a set-up: a count it may refuse is not named
        return None


def _fits_host(table: CandidateTable, host_limit: int | None) -> np.ndarray:
    """Which rows fit the host RAM (all where it is not checked)."""
    return table.host <= host_limit if host_limit is not None else np.ones(len(table.host), bool)


class _EstimatesSpent(Exception):
    """The FSDP2 hint's full estimates ran out (``_FSDP2_ESTIMATES``)."""


# A full estimate of one set-up: its peak (with any correction) and its trace; the text says which set-up it is (for
# the progress line: "the fastest candidate left").
Estimate = Callable[[PlanSettings, str], tuple[float, Trace]]


def _plan_estimate(ctx: Problem, composer: Composer, correction_bytes: int) -> Estimate:
    """The plan's ``Estimate``: ``estimate_of`` with ``correction_bytes``, each said on the progress line."""

    def estimate(s: PlanSettings, which: str) -> tuple[float, Trace]:
        PROGRESS.info(f"plan: a full estimate of {which} ({_setup_line(s)})")
        peak, t = estimate_of(ctx, composer.profile_of(s), s)
        return peak + correction_bytes, t

    return estimate


def _judged(results: CandidateTable, usable: int | None, host_limit: int | None, margin: float,
            estimate: Estimate, tries: int = _VERIFY_LIMIT) -> tuple[int | None, FullEstimates, np.ndarray]:
    """The row a plan chooses (None: none fits both budgets), every row estimated in full, and which rows fit the
    host RAM: the fastest confirmed by its full estimate (``_verified_fastest``); where none is, the row a refusal
    would name, estimated in full where it was not (what composition missed, and what the allocator's segments need
    beyond its peak, are a full estimate's), chosen if it fits after all. Each full estimate can raise other rows.
    Where no row fits the host RAM, none can be chosen: one estimate, for the figure. ``tries``: the fastest rows
    estimated in full at most (the near misses besides)."""
    fits_host = _fits_host(results, host_limit)
    fits = fits_host & (results.peak <= usable if usable is not None else True)
    chosen, estimates = _verified_fastest(results, fits, fits_host, usable, None if usable is None else margin,
                                          estimate, tries)
    if chosen is None and usable is not None and len(results.peak):
        chosen = _least_fitting(results, estimates, fits_host, usable, estimate)
    return chosen, estimates, fits_host


def _least_fitting(results: CandidateTable, estimates: FullEstimates, fits_host: np.ndarray, usable: int,
                   estimate: Estimate) -> int | None:
    """The row a refusal would name (the least as judged, within the host RAM where any is), estimated in full
    until it is one estimated already, or fits: that row, else None (``_judged``)."""
    for _ in range(_VERIFY_LIMIT if fits_host.any() else 1):
        k = refused_row(estimates.fitting_all(), fits_host)
        if k in estimates:
            break
        if estimates.add(k, *estimate(results.settings(k), "the least set-up left")) <= usable and fits_host[k]:
            return k
    return None


def _verified_fastest(results: CandidateTable, fits: np.ndarray, fits_host: np.ndarray, usable: int | None,
                      margin: float | None, estimate: Estimate,
                      limit: int = _VERIFY_LIMIT) -> tuple[int | None, FullEstimates]:
    """The fastest row whose full estimate fits ``usable`` (None: none did, within the tries), the caching
    allocator's least memory the budget (``usable`` and its ``margin``: ``fitting_peak``), and every row
    estimated in full (its peak, its trace), fastest first; ``limit``: the rows within the budget tried at most."""
    streamed = results.column("offload_weights").astype(bool)
    # Composition errs on the high side where a step's structure changes with the micro-batch (the loss's chunk
    # count, what is large enough to offload): a few faster candidates just over the budget get a full estimate
    # too, on a quota of their own.
    band = fits_host & (results.peak <= usable * (1 + _VERIFY_BAND) if usable is not None else True)
    # Each full estimate says what composition missed for its shape of candidate and what the allocator's segments
    # need beyond its peak: later rows carry both (``FullEstimates``).
    estimates = FullEstimates(results, margin)
    chosen, tries, near_misses = None, 0, 0
    order = results.order[band[results.order]]
    if (fits & ~streamed).any():
        # Parameter offload is for weights that do not fit the device: tried after every other set-up.
        order = np.concatenate([order[~streamed[order]], order[streamed[order]]])
    for k in order:
        k = int(k)
        composed = estimates.fitting(k)
        near_miss = usable is not None and composed > usable
        if usable is not None and composed > usable * (1 + _VERIFY_BAND):
            continue
        if (near_misses >= _NEAR_MISSES) if near_miss else (tries >= limit):
            if tries >= limit:
                break
            continue
        peak, t = estimate(results.settings(k), "the fastest candidate left")
        near_misses, tries = near_misses + near_miss, tries + (not near_miss)
        fitting = estimates.add(k, peak, t)
        if usable is None or fitting <= usable:
            chosen = k
            break
    return chosen, estimates
