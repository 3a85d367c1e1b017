"""The plan's ``Hint:`` lines: the pure bf16 candidates (searched when the user fixes ``pure_bf16``, otherwise
composed only for one hint, or a fix named by the nothing-fits error, since pure bf16 changes the numerics and the
plan never picks it on its own), and sizes that work but are rarely meant (``size_hints``): the built-in GPT's
position table grown past the rest of the model, a step predicted to take many minutes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memtrain import techniques
from memtrain.message import arg
from memtrain.models import GPT
from memtrain.planner.cost import CandidateTable, Composer, fitting_peak
from memtrain.planner.settings import Fixed, PlanSettings, Problem
from memtrain.report import format_bytes

_HINT_TRIES = 3  # full estimates of pure bf16 candidates, fastest first, before giving up on that hint
# A faster pure bf16 set-up is worth a hint only when it is this much faster: a change of numerics for less is not
# worth suggesting, and it is within the cost model's error (LoRA's few trainable weights gain about 0.2%).
HINT_MIN_GAIN = 0.05
# A step predicted to take this long gets a hint: minutes a step is rarely meant (a sequence far longer than the
# model was sized for, a large model on a CPU), and the user sees nothing move for that long.
SLOW_STEP_HINT_S = 300.0
# The built-in GPT learns one position vector per token of --seq-len: past this share of the model's parameters the
# sequence length, not the model, sets its size.
POSITION_TABLE_HINT_SHARE = 0.5


@dataclass(frozen=True)
class PureBF16Hint:
    """The fastest pure bf16 set-up that fits both budgets (a full estimate of its peak)."""

    settings: PlanSettings
    peak_bytes: float
    host_bytes: float
    seconds: float
    tokens_per_s: float

    @property
    def fix(self) -> str:
        """E.g. "pure_bf16=True, which fits in 19.1 GiB per rank with 45.0 GiB of host RAM at 1,234 tokens/s (...)"
        (the CLI says --pure-bf16): marked text, a part of the nothing-fits message (``memtrain.message``)."""
        return self.text(arg("pure_bf16", True))

    def text(self, option: str) -> str:
        s = self.settings
        return (f"{option}, which fits in {format_bytes(int(self.peak_bytes))} per rank with "
                f"{format_bytes(int(self.host_bytes))} of host RAM at {self.tokens_per_s:,.0f} tokens/s (micro-batch "
                f"{s.micro_batch_size} x {s.accumulation}, checkpointing {s.checkpointing}, optimizer "
                f"{s.optimizer_text}; bf16 weights with no fp32 master and stochastically rounded updates: it changes "
                "the numerics, so the plan takes it only when asked for)")


def pure_bf16_candidate(composer: Composer, space: Any, fixed: Fixed, micros: Sequence[int], per_rank: int,
                        host_limit: int | None, usable: int | None,
                        faster_than: float | None, correction_bytes: int, *, search: Callable[..., None],
                        estimate: Callable[..., tuple[float, Any]], margin: float | None = None) -> PureBF16Hint | None:
    """The fastest pure bf16 set-up that fits (and is ``HINT_MIN_GAIN`` faster than ``faster_than`` seconds a step,
    when given), for the hint; None when pure bf16 is fixed already, the run names another optimizer than AdamW
    (pure bf16 is AdamW's), cannot run here (no bf16 profiles: not
    bf16-mixed on a GPU) or nothing fits.

    ``search`` and ``estimate`` are ``memtrain.planner.search``'s ``_search`` and ``estimate_of``; ``margin`` the
    budget's, which the allocator's segments may take too (``fitting_peak``; None: no budget).
    """
    if fixed.pure_bf16 or "bf16" not in composer.profiles or not fixed.optimizer_class.is_adamw:
        return None
    pure_space = dataclasses.replace(space, **{f.name: list(getattr(space, f.name)) for f in dataclasses.fields(space)
                                               if isinstance(getattr(space, f.name), list)})
    # NOTE: no partial offloads for the hint (a quarter of the candidates to compose): the whole optimizer on the
    # device or on the host, unless the run fixed its share.
    share = {} if fixed.offload_fraction is not None else {"offload_fraction": 0.0}
    pure_fixed = dataclasses.replace(fixed, pure_bf16=True, **share)
    for technique in techniques.REGISTRY:  # the space as a run that asks for pure bf16 would have it
        technique.narrow(pure_space, pure_fixed)
    if not (pure_space.placements and pure_space.states and pure_space.distributions):
        return None
    table = CandidateTable(len(composer.ctx.block_names))
    search(composer, table, pure_space, pure_fixed, micros, per_rank)
    if table.empty:
        return None
    table.finish()
    table.peak = table.peak + correction_bytes
    fits = np.ones(len(table.peak), bool)
    if usable is not None:
        fits &= table.peak <= usable
    if host_limit is not None:
        fits &= table.host <= host_limit
    if faster_than is not None:
        fits &= table.seconds * (1 + HINT_MIN_GAIN) <= faster_than
    tokens = composer.ctx.global_batch * composer.ctx.seq_len
    for k in table.order[fits[table.order]][:_HINT_TRIES]:
        s = table.settings(int(k))
        peak, t = estimate(composer.ctx, composer.profile_of(s), s)
        peak += correction_bytes
        if usable is None or fitting_peak(peak, t, margin) <= usable:
            seconds = float(table.seconds[k])
            return PureBF16Hint(s, peak, float(table.host[k]), seconds, tokens / seconds)
    return None


# The widest FSDP2 a refusal's hint tries: a set-up whose rank's activations alone exceed the budget fits at none.
MOST_RANKS = 2**16
# The ranks of a node (``memtrain.planner.cost.ranks_per_node``): up to there, the host RAM a node needs grows with its
# ranks, so each rank count is judged in turn; past it, both figures a rank needs shrink as the ranks grow.
_NODE_RANKS = 8


@dataclass(frozen=True)
class FSDP2Fit:
    """The fewest ranks over which one of the plan's FSDP2 set-ups fits both budgets, as the plan over them judges,
    and the set-up it chooses there: its peak (a full estimate) and its host RAM a node."""

    ranks: int
    settings: PlanSettings
    peak_bytes: float
    host_bytes: float

    @property
    def fix(self) -> str:
        """E.g. "FSDP2 over 3 GPUs (--nproc 3 --fsdp --global-batch-size 48: ...; micro-batch 16 x 1, ... would peak
        at 14.2 GiB per rank ...)": marked text, a part of the nothing-fits message."""
        s = self.settings
        per_rank = s.micro_batch_size * s.accumulation
        return (f"FSDP2 over {self.ranks} GPUs ({arg('world_size', self.ranks)} {arg('fsdp', True)} "
                f"{arg('global_batch_size', per_rank * self.ranks)}: parameters, gradients and optimizer state "
                f"sharded over the ranks, each taking the {per_rank} examples a step it takes now; micro-batch "
                f"{s.micro_batch_size} x {s.accumulation}, checkpointing {s.checkpointing}, optimizer "
                f"{s.optimizer_text} would peak at {format_bytes(int(self.peak_bytes))} per rank with "
                f"{format_bytes(int(self.host_bytes))} of host RAM a node)")


def fsdp2_fit(bound: Callable[[int], FSDP2Fit | None], fits: Callable[[int], FSDP2Fit | None],
              chosen: Callable[[int], FSDP2Fit | None], start: int, refused: set[int] | None = None,
              looser: Callable[[int], FSDP2Fit | None] | None = None) -> FSDP2Fit | None:
    """The fewest ranks from ``start`` at which the plan over them finds a set-up, with the set-up ``chosen(ranks)``
    names there (the fastest that fits, as that plan chooses it). None where none fits at ``MOST_RANKS``, or the plan
    over none of the counts tried finds one.

    Three steps. ``bound(ranks)``, the plan's judgement passing over counts where composition says nothing can fit,
    finds a count that fits (``_fewest``). ``fits(ranks)``, that judgement on every count, then walks down from it
    (``_fewer``): composition can err high. Last, ``chosen(ranks)`` judges with more tries, which can find another
    row that sets what composition missed and refuse the count: then the next counts, up to twice as many.

    ``refused``: the counts judged in full and refused so far (``bound`` fills it), not judged again. Where ``bound``
    finds no count, ``looser`` looks instead (a wider band: composition was seen to err high, as memtrain's own
    chunked loss on a torch without ``F.linear_cross_entropy`` does), if given; else no count fits."""
    refused = set() if refused is None else refused
    upper = _fewest(bound, start)
    if upper is None and looser is not None:
        upper = _fewest(functools.partial(_unless, looser, refused), start)
    if upper is None:
        return None
    least = _fewer(functools.partial(_unless, fits, refused), upper, start)
    last = min(2 * least.ranks, MOST_RANKS)
    return next((named for ranks in range(least.ranks, last + 1) if (named := chosen(ranks))), None)


def _unless(test: Callable[[int], FSDP2Fit | None], refused: set[int], ranks: int) -> FSDP2Fit | None:
    return None if ranks in refused else test(ranks)


def _fewest(test: Callable[[int], FSDP2Fit | None], start: int) -> FSDP2Fit | None:
    """``test(ranks)`` at the fewest ranks from ``start`` where it is not None: each count in turn up to a node's
    ranks (its host RAM grows with its ranks), then doubled until one passes, then bisected. None where none passes
    at ``MOST_RANKS``."""
    ranks = start
    while ranks <= _NODE_RANKS:
        if (passed := test(ranks)) is not None:
            return passed
        ranks += 1
    below, ranks = ranks - 1, (2 * _NODE_RANKS if start <= _NODE_RANKS else start)
    while (passed := test(ranks)) is None:
        if ranks >= MOST_RANKS:
            return None
        below, ranks = ranks, min(2 * ranks, MOST_RANKS)
    return _bisected(test, below, passed)


def _fewer(test: Callable[[int], FSDP2Fit | None], passed: FSDP2Fit, start: int) -> FSDP2Fit:
    """From ``passed`` (a count that fits), the fewest ranks down to ``start`` where ``test`` passes. Above a node's
    ranks: one fewer, then steps doubled until one fails, then bisected. Within a node (its host RAM grows with its
    ranks, so a count can fit where the next does not), each count in turn, fewest first, as ``_fewest`` does.

    Where a count above the node fails, the counts within it are not judged again: the bound passed them over or
    refused them. A set-up that fits within a node and not at the counts above it (a node's host RAM holds each
    rank's own buffers: more above it) is missed there only where composition errs high by more than the bound's
    band; judging those counts in full would spend the full estimates a refusal on a large model needs."""
    step, floor = 1, max(start, _NODE_RANKS + 1)
    while passed.ranks > floor:
        ranks = max(floor, passed.ranks - step)
        if (closer := test(ranks)) is None:
            return _bisected(test, ranks, passed)
        passed, step = closer, 2 * step
    return next((fit for ranks in range(start, min(passed.ranks, floor)) if (fit := test(ranks))), passed)


def _bisected(test: Callable[[int], FSDP2Fit | None], below: int, passed: FSDP2Fit) -> FSDP2Fit:
    """Between ``below`` (fails) and ``passed.ranks`` (passes), the fewest ranks where ``test`` passes."""
    ranks = passed.ranks
    while ranks - below > 1:
        middle = (below + ranks) // 2
        if (closer := test(middle)) is not None:
            ranks, passed = middle, closer
        else:
            below = middle
    return passed


def hint_lines(hint: PureBF16Hint | None, chosen_seconds: float) -> tuple[str, ...]:
    """The plan's ``Hint:`` line when the pure bf16 set-up is at least ``HINT_MIN_GAIN`` faster than the chosen one."""
    if hint is None or hint.seconds * (1 + HINT_MIN_GAIN) > chosen_seconds:
        return ()
    return (f"Hint: {hint.text('--pure-bf16 (pure_bf16=True)')}, would be {100 * (chosen_seconds / hint.seconds - 1):.1f}% faster than this plan",)


def size_hints(ctx: Problem, step_seconds: float) -> tuple[str, ...]:
    """``Hint:`` lines for sizes that work but are rarely meant: the built-in GPT's learned position table holding
    more than ``POSITION_TABLE_HINT_SHARE`` of its parameters (it grows with ``seq_len``: a Hugging Face model
    refuses a ``seq_len`` past its ``max_position_embeddings`` instead), and a step predicted to take more than
    ``SLOW_STEP_HINT_S`` seconds."""
    lines = []
    gpt = next((m for m in ctx.model.modules() if isinstance(m, GPT)), None)
    if gpt is not None:
        table = gpt.wpe.weight.numel()
        total = sum(p.numel() for p in gpt.parameters())
        if table > POSITION_TABLE_HINT_SHARE * total:
            width = gpt.wpe.embedding_dim
            at_most = max(1, (total - table) // width)  # the seq_len whose table is as large as the rest
            lines.append(
                f"Hint: --seq-len {ctx.seq_len} (seq_len) gives the built-in GPT a learned position table of "
                f"{ctx.seq_len:,} x {width} = {table / 1e6:.2f}M parameters, {table / total:.0%} of its "
                f"{total / 1e6:.2f}M (the table grows with the sequence length; the rest of the model does not), and "
                "attention's time and memory grow with the square of the sequence. To train on long sequences, pass "
                f"a larger --model; to keep this one, a --seq-len of {at_most:,} or less keeps the table at most half "
                "of the model")
    if step_seconds > SLOW_STEP_HINT_S:
        tokens = ctx.global_batch * ctx.seq_len
        where = "the CPU" if ctx.device == "cpu" else f"the {ctx.device} device"
        lines.append(
            f"Hint: the plan predicts {step_seconds / 60:,.1f} minutes a step on {where} ({tokens:,} tokens a step at "
            f"{tokens / step_seconds:,.0f} tokens/s): nothing moves on the progress bar for that long. To make a step "
            "shorter, pass a shorter --seq-len (attention's time grows with its square), a smaller "
            f"--global-batch-size or a smaller model{', or train on a GPU' if ctx.device == 'cpu' else ''}")
    return tuple(lines)
