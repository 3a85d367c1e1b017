"""What a plan says about itself: a reason for each decision, the runners-up and why each lost, the assumptions,
and the "nothing fits" error that says which budget is short, by how much, and what would make a plan fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from memtrain import techniques
from memtrain.device import active_simulation
from memtrain.device.allocator import expandable_segments
from memtrain.errors import ConfigError
from memtrain.estimate.cuda import CUDA_WORKSPACE_BYTES
from memtrain.message import arg
from memtrain.offload import SLAB_BYTES_DEFAULT
from memtrain.planner.cost import (
    LOADER_BATCHES,
    CandidateTable,
    Composer,
    FullEstimates,
    fsdp2_param_dtype,
    ranks_per_node,
)
from memtrain.planner.hint import FSDP2Fit
from memtrain.planner.settings import Candidate, PlanSettings, Problem, configuration_of
from memtrain.report import format_bytes
from memtrain.techniques.optimizer.cost import LEAN_MARGIN
from memtrain.techniques.weight_offload import weights_in_host_ram, weights_shift


def _compared(ratio: float, lean: bool) -> str:
    """``_slower``, or for lean moments the search passed over by its margin (``techniques.optimizer.cost.LEAN_MARGIN``) how little
    faster they are."""
    if lean and ratio <= 0.999:
        return f"{100 * (1 - ratio):.1f}% faster, less than the {100 * LEAN_MARGIN:.0f}% that changing the " \
               "moments' numerics must gain"
    return _slower(ratio)


def _slower(ratio: float) -> str:
    """A step-time ratio in words: "3.2% slower", or "as fast (within 0.1%)"."""
    return f"{100 * (ratio - 1):.1f}% slower" if ratio >= 1.001 else "as fast (within 0.1%)"


def _over_text(peak: float, fitting: float, usable: int | None, margin: float | None) -> str:
    """How far a set-up is over the usable bytes: its peak's excess, and what the allocator's segments need of the
    whole budget where they need more (``fitting_peak``)."""
    assert usable is not None and margin is not None  # with no budget, only the host RAM can be short
    need = format_bytes(int((fitting - usable) / (1 - margin)))
    if peak <= usable:
        return f"the caching allocator's segments need {need} more than the budget"
    segments = f"; its caching allocator's segments need {need} more than the budget" if fitting > peak else ""
    return f"over budget by {format_bytes(int(peak - usable))}{segments}"


def _why_lost(results: CandidateTable, k: int, chosen: int, peak: float, fitting: float, fits: np.ndarray,
              fits_host: np.ndarray, usable: int | None, host_limit: int | None, margin: float | None) -> str:
    if not fits_host[k]:
        device = f"; {_over_text(peak, fitting, usable, margin)}" if usable is not None and fitting > usable else ""
        return f"host RAM: needs {format_bytes(int(results.host[k]))} of {format_bytes(host_limit)}{device}"
    if not fits[k]:
        return _over_text(peak, fitting, usable, margin)
    ratio = results.seconds[k] / results.seconds[chosen]
    if ratio >= 1 / 1.001:
        return _slower(ratio)
    faster = f"{100 * (1 - ratio):.1f}% faster"
    if weights_in_host_ram(results.settings(k)) and not weights_in_host_ram(results.settings(chosen)):
        # ``_verified_fastest``: parameter offload is for weights that do not fit the device
        return (f"{faster}, but it streams the weights from host RAM, which the plan chooses only where no set-up "
                "that keeps them on the device fits")
    return f"{faster} as composed, but not confirmed: the plan's full estimates ran out before it"


def _family_codes(results: CandidateTable) -> np.ndarray:
    """Each row's family as an integer (rows of one family share one): the checkpointing's shape (none, all
    recomputed, mixed), the recompute flavor where a block recomputes, whether a block offloads, the loss, the
    optimizer, the micro-batch, the distribution and compile. From the table's columns: the 70B's table has
    millions of rows, too many to build each one's settings."""
    n, ids = results.n_blocks, {}
    first = [c.assigned(n, 0, 0) for c in results.configs]  # the family's fields but the blocks' are the config's
    rest = [(s.loss_text, s.optimizer_text, s.micro_batch_size, s.distribution, s.compile) for s in first]
    # The flavor is the configuration's (an all-kept layout's settings write "full": no block recomputes there)
    flavored = np.array([ids.setdefault((c.flavor, *r), len(ids)) for c, r in zip(results.configs, rest, strict=True)])
    plain = np.array([ids.setdefault(("-", *r), len(ids)) for r in rest])
    recomputes = results.recompute > 0
    config = np.where(recomputes, flavored[results.config], plain[results.config])
    shape = np.where((results.offload == 0) & ~recomputes, 0, np.where(results.recompute == n, 1, 2))
    return (config * 3 + shape) * 2 + (results.offload > 0)


def _first_of_each(rows: np.ndarray, codes: np.ndarray, seen: set[int], limit: int) -> list[int]:
    """The first ``limit`` of ``rows`` (in order) of a family not ``seen`` and not met earlier in ``rows``."""
    row_codes = codes[rows]
    _, first = np.unique(row_codes, return_index=True)
    return [int(rows[i]) for i in np.sort(first) if int(row_codes[i]) not in seen][:limit]


def runners_up(ctx: Problem, composer: Composer, results: CandidateTable, chosen: int,
                estimates: FullEstimates, fits: np.ndarray, fits_host: np.ndarray, usable: int | None,
                host_limit: int | None) -> list[Candidate]:
    """Up to three faster candidates that do not fit and five slower ones that do, one of each family (the shape
    of the checkpointing, the loss, the optimizer, the micro-batch, ...): of each family the fastest, each with why
    it lost."""
    tokens_per_step = ctx.global_batch * ctx.seq_len
    codes = _family_codes(results)
    order = results.order[results.order != chosen]
    # The table is ranked fastest first: the faster rows come before every other one. A slower one that does not fit
    # says nothing.
    faster = results.seconds[order] < results.seconds[chosen]
    slower = order[~faster & fits[order] & fits_host[order]]
    picked = _first_of_each(order[faster], codes, {int(codes[chosen])}, 3)
    picked += _first_of_each(slower, codes, {int(codes[chosen]), *(int(codes[k]) for k in picked)}, 5)
    out = []
    for k in picked:
        s, peak = results.settings(k), estimates.peak(k)
        out.append(Candidate(s, int(peak), int(results.host[k]), float(results.seconds[k]),
                             tokens_per_step / float(results.seconds[k]), k in estimates,
                             _why_lost(results, k, chosen, peak, estimates.fitting(k), fits, fits_host, usable,
                                       host_limit, estimates.margin),
                             composer.host_link(s)))
    return out


def plan_reasons(ctx: Problem, results: CandidateTable, chosen: int, peak: float, estimates: FullEstimates,
                 judged: np.ndarray, fits_host: np.ndarray, usable: int | None, host_limit: int | None) -> list[str]:
    """One line per decision: what was chosen, and what the best alternative to that one decision costs (each row
    ``judged`` as the search judges it: ``estimates.fitting_all()``)."""
    s = results.settings(chosen)
    budget_text = "no budget" if usable is None else f"the usable {format_bytes(usable)}"
    if results.explicit and not results.searched:  # nothing was searched: the set-up was given
        return [f"precision {ctx.precision}, checkpointing {s.checkpointing}, loss "
                f"{s.loss_text}, optimizer {s.optimizer_text}, micro-batch "
                f"{s.micro_batch_size} x {s.accumulation} accumulation (as asked: no search)",
                _peak_reason(peak, budget_text)]
    alternative = _Alternatives(results, chosen, estimates, judged, fits_host, usable, budget_text)
    view = _View(settings=s, chosen=chosen, device=ctx.device, world=ctx.world, per_rank=ctx.global_batch // ctx.world,
                 chunkable=ctx.chunkable, grad_clip=ctx.grad_clip, budget_text=budget_text, offload=results.offload,
                 recompute=results.recompute, results=results, alternative=alternative)
    return [f"precision {ctx.precision_reason or f'{ctx.precision} (requested)'}",
            *(line for technique in techniques.REGISTRY for line in technique.reasons(view)),
            _peak_reason(peak, budget_text)]


@dataclass(frozen=True)
class _Alternatives:
    """What the best alternative to one decision costs, in words: the fastest row of ``mask`` that fits, timed
    against the chosen one; or, where none of them fits, what they need: the least host RAM of those that fit the
    device, else the smallest figure of them over the budget (its peak, or its allocator segments' need). Each row
    is ``judged`` as the search judges it (``FullEstimates.fitting_all``). Empty when no row of ``mask`` was
    composed."""

    results: CandidateTable
    chosen: int
    estimates: FullEstimates
    judged: np.ndarray
    fits_host: np.ndarray
    usable: int | None
    budget_text: str
    fits_device: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        fits = self.judged <= self.usable if self.usable is not None else np.ones(len(self.judged), bool)
        object.__setattr__(self, "fits_device", fits)

    def __call__(self, mask: np.ndarray, what: str, lean: bool = False) -> str:
        results = self.results
        best_fit = results.first(mask & self.fits_device & self.fits_host)
        if best_fit is not None:
            return f"{what} would be {_compared(results.seconds[best_fit] / results.seconds[self.chosen], lean)}"
        if not mask.any():
            return ""
        on_device = mask & self.fits_device
        if on_device.any():  # they fit the device, none the host RAM
            return f"{what} would need {format_bytes(int(results.host[on_device].min()))} of host RAM"
        smallest = int(np.flatnonzero(mask)[np.argmin(self.judged[mask])])
        peak = self.estimates.peak(smallest)
        assert self.usable is not None and self.estimates.margin is not None  # with no budget every row fits the device
        if peak <= self.usable:  # the allocator's segments set its figure
            need = math.ceil(self.judged[smallest] / (1 - self.estimates.margin))
            return f"{what} would need {format_bytes(need)} of the budget at least, for the caching allocator's segments"
        return f"{what} would peak at {format_bytes(int(peak))} at least, over {self.budget_text}"


@dataclass
class _View:
    """The chosen plan and its candidates as the techniques' reasons read them (``memtrain.techniques.PlanView``):
    a field's column, and the rows that share the chosen values, each computed once."""

    settings: PlanSettings
    chosen: int
    device: str
    world: int
    per_rank: int
    chunkable: bool
    grad_clip: bool
    budget_text: str
    offload: np.ndarray
    recompute: np.ndarray
    results: CandidateTable
    alternative: _Alternatives
    _columns: dict[str, np.ndarray] = field(default_factory=dict)

    def column(self, name: str) -> np.ndarray:
        if name not in self._columns:
            self._columns[name] = self.results.column(name)
        return self._columns[name]

    def same(self, *names: str) -> np.ndarray:
        mask = np.ones(len(self.offload), dtype=bool)
        for name in names:  # the chosen row's own value: its configuration's (a flavor without a recomputed block
            column = self.column(name)  # is its configuration's in the table, "full" in the settings)
            mask &= column == column[self.chosen]
        return mask


def _peak_reason(peak: float, budget_text: str) -> str:
    return f"predicted peak {format_bytes(int(peak))} per rank (a full estimate of this set-up) within {budget_text}"


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def plan_assumptions(ctx: Problem, margin: float, composer: Composer, host_limit: int | None) -> list[str]:
    dev = ctx.device_profile.for_precision(ctx.precision)  # the rates the step is timed at (a CPU's 16-bit ones)
    out = [
        f"device figures: {dev.source}: matmuls {_flops(dev.matmul_flops)} (half of it at "
        f"{dev.half_efficiency_tokens:.0f} tokens), attention {_flops(dev.attention_flops)}, memory "
        f"{dev.memory_bandwidth / 1e9:.1f} GB/s, {dev.op_overhead_s * 1e6:.1f} us per op, host link "
        f"{dev.host_to_device / 1e9:.1f} GB/s, CPU AdamW {dev.cpu_adamw / 1e9:.2f} G params/s",
        (f"safety margin {100 * margin:.0f}% of the budget for what the estimate does not see; the caching "
         f"allocator's least memory ({'expandable' if expandable_segments(default=True) else 'fixed'} segments, "
         "given back where an allocation fails) within the whole budget" if ctx.device == "cuda" else
         f"safety margin {100 * margin:.0f}% of the budget for the allocator's fragmentation"),
        ("the runners-up's peaks are composed from per-block profiles (marked *), each with the most a full estimate of "
         "its shape of set-up showed composition missed; the chosen peak is a full estimate"),
        "step time: matmul and attention FLOPs at the rates above, other ops by their memory traffic, a fixed cost "
        "per op; offloaded activations queue on the host link; the offloaded optimizer steps after backward",
    ]
    if ctx.kept_share < 1:
        out.append(f"the loss counts {100 * ctx.kept_share:.3g}% of the label positions (kept_share): the chunked "
                   "loss's head and logits are timed on that share (the last norm before them on every position); "
                   "the peak holds a batch whose every label counts")
    if ctx.world > 1:
        gathered = "in bf16 " if fsdp2_param_dtype(ctx.precision) == torch.bfloat16 else ""
        out.append("distributed memory by formula on a one-process estimate: DDP's gradients are views into its "
                   "all-reduce buckets (a second copy while accumulating); FSDP2 shards parameters and optimizer "
                   f"state (gradients too without accumulation), two blocks gathered {gathered}at a time, "
                   f"gradients reduced in fp32; host RAM is one node's ({ranks_per_node(ctx.world)} ranks)")
    if ctx.device == "cuda":
        out.append(f"host RAM at its peak: the offloaded optimizer's buffers and state as built, the activation "
                   f"offloader's pool in whole pinned slabs of {format_bytes(SLAB_BYTES_DEFAULT)}, and an allowance "
                   f"of {LOADER_BATCHES} pinned batches for the data loader")
    if host_limit is None:
        out.append("host RAM not checked (planned for another machine): pass host_budget to check it")
    out.append("compiled set-ups: memory as eager (compiled graphs keep no more), elementwise traffic halved, a "
               "tenth of the per-op overhead; where blocks offload activations only the blocks are compiled "
               "(compile_model), the code around them (embeddings, last norm, head, loss) is timed eager")
    traces = sum(p.traces for p in composer.profiles.values())
    out.append(f"profiles from {traces} traced steps")
    return out


def raise_nothing_fits(ctx: Problem, composer: Composer, results: CandidateTable,
                        estimates: FullEstimates, budget_bytes: int | None, usable: int | None,
                        host_limit: int | None, host_budget: int | None, margin: float, fits_host: np.ndarray,
                        options: list[str] | None = None, fsdp2: Callable[[], FSDP2Fit | None] | None = None) -> None:
    """The ConfigError when no candidate fits: which budget is short (the device, the host RAM, both or either),
    by how much (each figure beside the budget it is over), and the budgets or options that would fit
    (``options``: set-ups the plan does not take on its own that fit both budgets, e.g. pure bf16's; ``fsdp2``:
    the fewest ranks over which one of the plan's FSDP2 set-ups fits, a ``memtrain.planner.hint.FSDP2Fit``)."""
    assert usable is not None or host_limit is not None
    # Every row as the search judges it (a composed one with what the full estimates showed): a row that composes
    # within the budget but was not estimated in full is not named fitting.
    peaks = estimates.fitting_all()
    if results.explicit and not results.searched:
        s = results.settings(0)
        holds = ""
        if not fits_host[0]:
            where = f"needs {format_bytes(int(results.host[0]))} of host RAM, more than {format_bytes(host_limit)}"
        else:
            assert usable is not None and budget_bytes is not None
            where = _device_figures(estimates.peak(0), float(peaks[0]), usable, budget_bytes, margin)
            holds = f" ({arg('budget', text=_size_up(math.ceil(peaks[0] / (1 - margin))))} holds it)"
        raise ConfigError(
            f"the set-up asked for (micro-batch {s.micro_batch_size}, checkpointing {s.checkpointing}, loss "
            f"{s.loss_text}, optimizer {s.optimizer_text}) {where}. To resolve this error, "
            f"leave the choices to the plan (drop the fixed micro-batch or techniques), or raise the budget{holds}.")
    unconfirmed = fits_host & (peaks <= usable) if usable is not None else np.zeros(len(peaks), bool)
    if unconfirmed.any():  # the full estimates ran out before one of these was tried
        u = results.first(unconfirmed)
        raise ConfigError(
            f"the plan stopped before it confirmed a set-up: none of the {len(estimates)} estimated in full fits, and "
            f"{int(unconfirmed.sum())} set-ups never estimated in full compose within the budget from the block "
            f"profiles (the fastest: {_setup_text(results.settings(u))}, a composed peak of "
            f"{format_bytes(int(estimates.peak(u)))}). To resolve this error, fix the choices to that set-up (its "
            "micro-batch and techniques), which estimates it in full, or raise the budget.")
    fits_device = peaks <= usable if usable is not None else np.ones(len(peaks), bool)
    on_device, on_host = bool(fits_device.any()), bool(fits_host.any())
    # Each figure is stated beside the budget it is over: the least host RAM of the set-ups that fit the device,
    # and the smallest peak of those that fit the host (of all set-ups when none does).
    host_of = arg("host_budget") if host_budget is not None else "host RAM available now"
    k = refused_row(peaks, fits_host)
    h = int(np.argmin(np.where(fits_device, results.host, np.inf))) if on_device else int(np.argmin(results.host))
    clauses, fixes = [], []
    if host_limit is not None and (on_device or not on_host):
        need = int(results.host[h])
        device = "" if usable is None else f" of {format_bytes(usable)}"  # no budget: every set-up fits the device
        whose = (f"the set-ups that fit the device (smallest peak {format_bytes(int(peaks[fits_device].min()))}"
                 f"{device}) need at least" if on_device else "the least any set-up needs is")
        clauses.append(f"{whose} {format_bytes(need)} of host RAM, {format_bytes(need - host_limit)} over the "
                       f"{format_bytes(host_limit)} of {host_of}")
        both = ("" if on_device or usable is None else
                f" with {arg('budget', text=_size_up(math.ceil(peaks[h] / (1 - margin))))}")
        fixes.append(f"{arg('host_budget', text=_size_up(need))}{both} ({_setup_text(results.settings(h))}: a peak of "
                     f"{format_bytes(int(peaks[h]))} per rank)"
                     + ("" if host_budget is not None else " on a machine with that much RAM free"))
    if usable is not None and (on_host or not on_device):
        assert budget_bytes is not None
        allocated = estimates.peak(k)
        need = math.ceil(peaks[k] / (1 - margin))
        within_host = on_host and not fits_host.all()
        # Figures of this set-up's full estimate, or (the full estimates ran out) composed with what others showed.
        judged = "" if k in estimates else "; composed, with what other set-ups' full estimates showed"
        if allocated <= usable < peaks[k]:  # its peak fits: the allocator's segments (whole pages) set the figure
            whose = "the set-ups within the host RAM need at least" if within_host else "the least any set-up needs is"
            clauses.append(f"{whose} {format_bytes(need)} per rank ({_setup_text(results.settings(k))}: its "
                           f"{format_bytes(int(allocated))} peak fits the usable {format_bytes(usable)}, but its caching "
                           f"allocator segments need {format_bytes(need)}{judged}), {format_bytes(need - budget_bytes)} over "
                           f"the budget {format_bytes(budget_bytes)}")
        else:
            whose = "the set-ups within the host RAM peak at least at" if within_host else "the smallest predicted peak is"
            segments = (f"; its caching allocator segments need {format_bytes(need)} of the budget"
                        if peaks[k] > allocated else "")
            clauses.append(f"{whose} {format_bytes(int(allocated))} per rank ({_setup_text(results.settings(k))}"
                           f"{segments}{judged}), {format_bytes(int(allocated) - usable)} over the usable {format_bytes(usable)} "
                           f"(budget {format_bytes(budget_bytes)} less the {100 * margin:.0f}% safety margin)")
        fixes += _device_hints(ctx, composer, results.settings(k), float(peaks[k]), usable, margin, allocated, fsdp2)
    which = ("both budgets" if on_device and on_host else "the device" if on_host else
             "the host RAM" if on_device else "either budget")
    if which == "either budget":  # each fix needs the other budget raised too: the smallest peak's host RAM
        fixes[1:] = [f"{arg('host_budget', text=_size_up(int(results.host[k])))} and {fix}" for fix in fixes[1:]]
    fixes += options or []
    raise ConfigError(f"no set-up fits {which}: {'; '.join(clauses)}. To resolve this error, try "
                      f"{'; or '.join(fixes)}.")


def refused_row(fitting: np.ndarray, fits_host: np.ndarray) -> int:
    """The row a refusal names for the device: the least ``fitting`` peak (``FullEstimates.fitting_all``) of the rows
    within the host RAM, of all rows where none is."""
    return int(np.argmin(np.where(fits_host, fitting, np.inf))) if fits_host.any() else int(np.argmin(fitting))


def _device_figures(allocated: float, fitting: float, usable: int, budget_bytes: int, margin: float) -> str:
    """A set-up's device figures against the budget: its peak beside the usable bytes, and where they set its
    figure (``fitting_peak``), what its caching allocator segments need of the whole budget."""
    need = math.ceil(fitting / (1 - margin))
    if allocated <= usable < fitting:
        return (f"peaks at {format_bytes(int(allocated))} per rank, within the usable {format_bytes(usable)}, but its "
                f"caching allocator segments need {format_bytes(need)}, {format_bytes(need - budget_bytes)} over the "
                f"budget {format_bytes(budget_bytes)}")
    segments = f", and its caching allocator segments need {format_bytes(need)}" if fitting > allocated else ""
    return (f"peaks at {format_bytes(int(allocated))} per rank, {format_bytes(int(allocated) - usable)} over the usable "
            f"{format_bytes(usable)} ({format_bytes(budget_bytes)} less the {100 * margin:.0f}% margin){segments}")


def _setup_text(s: PlanSettings) -> str:
    return (f"micro-batch {s.micro_batch_size}, checkpointing {s.checkpointing}, loss "
            f"{s.loss_text}, optimizer {s.optimizer_text}")


def _size_up(n: int) -> str:
    """A size of at least ``n`` bytes, as a flag takes it: whole GiB, or whole MiB below 1 GiB."""
    return f"{math.ceil(n / 2**30)}GiB" if n >= 2**30 else f"{math.ceil(n / 2**20)}MiB"


def _bytes_up(n: int) -> str:
    """``format_bytes`` rounded up, not to the nearest: the figure passed back as a budget holds ``n`` bytes
    (125.20 MiB for 125.204 would not)."""
    unit, size = next(((u, z) for u, z in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= z), ("B", 1))
    return f"{n} B" if size == 1 else f"{math.ceil(n * 100 / size) / 100:.2f} {unit}"


def _device_hints(ctx: Problem, composer: Composer, s: PlanSettings, peak: float, usable: int,
                  margin: float, allocated: float | None = None,
                  fsdp2: Callable[[], FSDP2Fit | None] | None = None) -> list[str]:
    """What would let set-up ``s``, the smallest figure ``peak`` (``fitting_peak``'s: its ``allocated`` peak, or
    its allocator segments' need less the margin), fit the usable device bytes: a budget that holds it, FSDP2 over
    more ranks (``fsdp2``: where one of the plan's FSDP2 set-ups fits), a shorter sequence."""
    allocated = peak if allocated is None else allocated
    if allocated <= usable < peak:  # whole pages, not what the step holds: no shorter sequence or more ranks
        return [f"a larger budget ({arg('budget', text=_size_up(math.ceil(peak / (1 - margin))))} holds that "
                "set-up's caching allocator segments)"]
    segments = " and its caching allocator segments" if peak > allocated else ""
    fits = (f"{arg('budget', text=_size_up(math.ceil(peak / (1 - margin))))} holds that set-up's peak with the "
            f"{100 * margin:.0f}% margin{segments}")
    hints = [f"a larger budget ({fits})"]
    prof = composer.profile_of(s)
    shards = ctx.world if s.distribution == "fsdp2" else 1  # the smallest peak's model state is per rank
    # The weights as the device holds them: the profile's dtype (bf16 beside an offloaded master), the streamed
    # blocks' but two gone
    weights = (prof.parameter_bytes + weights_shift(prof, s)) / shards
    memory = composer.share(prof, configuration_of(s)).memory  # its moments' precision, its gradients' life
    state = weights + (memory.device_state_bytes + memory.device_gradient_peak_bytes) / shards
    if fsdp2 is not None and (fit := fsdp2()) is not None:
        hints.append(fit.fix)
    activations = allocated - state  # what the step holds, not the segments' rounding
    # Fixed: no sequence length shrinks it (a simulated device computes with the CPU's kernels: none).
    workspace = CUDA_WORKSPACE_BYTES if ctx.device == "cuda" and active_simulation() is None else 0
    if weights >= usable:
        hints[0] = f"a larger budget: the weights alone take {format_bytes(int(weights))} on the device ({fits})"
    elif state >= usable:
        hints[0] = (f"a larger budget: the model state alone (weights, gradients, optimizer state) takes "
                    f"{format_bytes(int(state))} on the device ({fits})")
    elif state + workspace >= usable:
        least = math.ceil(peak / (1 - margin))
        hints[0] = (f"a budget of at least {_bytes_up(least)} ({arg('budget', text=_size_up(least))}): cuBLAS's fixed "
                    f"workspaces alone take {format_bytes(workspace)} (two of 32 MiB, whatever the sequence or batch) "
                    f"beside the model state's {format_bytes(int(state))}")
    elif activations > usable - state and ctx.seq_len > 1:  # not a length: the activations are not linear in it (fixed buffers)
        fixed = f", {format_bytes(workspace)} of it cuBLAS's fixed workspaces" if workspace else ""
        # Worded as a change ("below"): "at seq_len 1024" reads as --seq-len 1024 in the command's terms.
        hints.append(f"{arg('seq_len')} below {ctx.seq_len} (at {ctx.seq_len} tokens a micro-batch of "
                     f"{s.micro_batch_size} needs {format_bytes(int(activations))}{fixed} beside the model state's "
                     f"{format_bytes(int(state))})")
    else:
        hints[0] = (f"a larger budget: a micro-batch of {s.micro_batch_size} alone needs "
                    f"{format_bytes(int(activations))} beside the model state ({fits})")
    return hints
