"""Tests of memtrain.planner: the cost model: composed peaks against full estimates, DDP/FSDP2 memory and links, the host link, compiled timing."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from helpers import MiB, h100, planner_gpt, planner_llama

from memtrain.estimate import meta_model
from memtrain.models import GPT, GPTConfig
from memtrain.offload import SLAB_BYTES_DEFAULT
from memtrain.planner import (
    PlanSettings,
    plan,
    predictions,
)
from memtrain.planner.cost import loader_host_bytes

transformers = pytest.importorskip("transformers")

H100 = h100()





def _per_rank_and_one_process(config, settings: PlanSettings, world: int, **kwargs):
    """The plan of ``settings`` over ``world`` ranks and of the same set-up in one process (the same micro-batch
    and accumulation: the same activations), both full estimates."""
    micro, acc = settings.micro_batch_size, settings.accumulation
    common = dict(budget=None, seq_len=64, device_profile=H100, precision=settings.precision, **kwargs)
    ranks = plan(config, global_batch_size=micro * acc * world, world_size=world,
                 fsdp=settings.distribution == "fsdp2", settings=settings, **common)
    one = plan(config, global_batch_size=micro * acc, settings=dataclasses.replace(settings, distribution="none"),
               **common)
    return ranks, one


# -- bytes over the host link, and what compile_model compiles ------------------------------------------------
def _offload_gpt() -> GPT:
    # Block inputs of 256 x 256 fp32 per example: 256 KiB at micro-batch 1, the offloader's 1 MiB at 4.
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, seq_len=256, vocab_size=256, dropout=0.0))


# -- composition: a candidate's peak from per-block profiles equals a full estimate of it ---------------------
def test_composed_peaks_match_full_estimates_of_mixed_set_ups():
    """Random mixes of kept, recomputed (fully, selectively, inputs offloaded) and offloaded blocks, micro-batches,
    losses and optimizers (placement, moment precision, step in backward, partial offload), on a Llama shape whose
    sequence is a multiple of the loss's chunk: the composed peak is within 3% of a full estimate of the same
    set-up. (The profiles let the offloader move every saved tensor, the real one keeps those under 1 MiB: on a
    model this small, per-row statistics of a few KiB make up to about 2.5% of the peak.)"""
    from memtrain.planner.cost import Composer
    from memtrain.planner.search import estimate_of, problem_of
    from memtrain.planner.settings import Configuration
    from memtrain.planner.tracing import build_profiles

    config = planner_llama(layers=5, hidden=1024, vocab_size=8192)
    ctx = problem_of(config, 2048, 4, "cuda", "bf16-mixed", 1, True, True, H100)
    flavors = ["full", "selective", "offload-inputs"]
    composer = Composer(ctx, {None: build_profiles(ctx, flavors, True, None), "bf16": build_profiles(ctx, flavors, True,
                                                                                         "bf16")})
    rng = random.Random(0)
    errors = []
    for _ in range(14):
        b = rng.choice([1, 2, 4])
        placement = rng.choice(["device", "device", "offload", "offload-bf16-weights"])
        lean = placement == "device"
        cfg = Configuration(micro_batch_size=b, accumulation=4 // b, flavor=rng.choice(flavors),
                            chunked_loss=rng.random() < 0.5, optimizer=placement, distribution="none", compile=False,
                            precision="bf16-mixed",
                            state_precision=rng.choice(["fp32", "bf16", "int8"]) if lean else "fp32",
                            step_in_backward=lean and b == 4 and rng.random() < 0.5,
                            offload_fraction=rng.choice([0.0, 0.5]) if lean else 0.0)
        if cfg.offload_fraction:
            cfg = dataclasses.replace(cfg, state_precision="fp32", step_in_backward=False)
        o = rng.randint(0, 5) if rng.random() < 0.5 else 0
        r = rng.randint(0, 5 - o)
        composed = composer.rows(cfg, o, np.array([r]))[0][0]
        settings = cfg.assigned(5, o, r)
        estimated, _ = estimate_of(ctx, composer.profile(cfg.optimizer), settings)
        errors.append((composed / estimated - 1, settings.checkpointing, cfg))
    worst = max(errors, key=lambda e: abs(e[0]))
    assert abs(worst[0]) <= 0.03, f"composed vs full estimate: worst {100 * worst[0]:+.2f}% for {worst[1:]}"


def test_composed_peaks_with_accumulation_and_the_chunked_loss_match_the_full_estimate():
    """The chunked loss allocates the head's gradient at its first chunk and fills it over the rest: a streaming
    optimizer (or accumulation) lets it go when it lands, not when it is allocated; counted from its allocation,
    the composed peak falls one fp32 head weight short."""
    from memtrain.planner.cost import Composer
    from memtrain.planner.search import estimate_of, problem_of
    from memtrain.planner.settings import Configuration
    from memtrain.planner.tracing import build_profiles

    config = planner_llama(layers=5, hidden=1024, vocab_size=8192)
    ctx = problem_of(config, 2048, 4, "cuda", "bf16-mixed", 1, True, True, H100)
    composer = Composer(ctx, {None: build_profiles(ctx, ["full"], True, None)})
    for placement in ("offload", "device"):
        cfg = Configuration(micro_batch_size=1, accumulation=4, flavor="full", chunked_loss=True,
                            optimizer=placement,
                            distribution="none", compile=False, precision="bf16-mixed", state_precision="fp32",
                            step_in_backward=False, offload_fraction=0.0)
        composed = composer.rows(cfg, 0, np.array([0]))[0][0]
        estimated, _ = estimate_of(ctx, composer.profile(placement), cfg.assigned(5, 0, 0))
        assert abs(composed / estimated - 1) <= 0.01, (placement, composed / MiB, estimated / MiB)


def test_an_fsdp2_rank_holds_every_saved_activation_beside_its_shard_of_the_state():
    """At the start of backward a rank holds all its saved activations and its shard of the weights and moments;
    the gradients FSDP2 shards do not exist yet (a shift that takes them off every moment plans below this)."""
    config = planner_llama(layers=16, hidden=1024, vocab_size=256, num_attention_heads=16, num_key_value_heads=16)
    numel = sum(p.numel() for p in meta_model(config).parameters())
    p = plan(config, budget=None, seq_len=1024, global_batch_size=16, world_size=16, fsdp=True, device_profile=H100,
             techniques=[], micro_batch_size=1)
    at_least = p.activation_bytes + 12 * numel / 16  # fp32 weights and two fp32 moments, a sixteenth of each
    assert p.peak_bytes >= at_least, (p.peak_bytes / MiB, at_least / MiB)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "linear_cross_entropy"), reason=(
    f"torch {torch.__version__} has no F.linear_cross_entropy: the chunked loss is memtrain's kernel, whose composed "
    "peak is not exact (the full estimate is), so composition cannot stand for what a rank holds"))
@pytest.mark.parametrize("world", [2, 8])
def test_an_fsdp2_rank_holds_the_roots_gradients_whole_until_the_end_of_backward(world):
    """FSDP2 reduce-scatters the root's gradients (the head's, the embeddings') only once the whole backward is done
    (``test_fsdp2_keeps_the_roots_gradient_unsharded_through_the_blocks_backward`` shows it on this torch): in the
    blocks' backward a rank holds the head's whole fp32 gradient beside its shards, as the composed peak always
    counted. The full estimate now equals it; before, it took (1 - 1/N) of the head's gradient off from the head's
    backward on: 62.48 MiB (2 ranks) and 109.36 MiB (8 ranks) below it here, at 512 tokens."""
    config = planner_llama(layers=4, hidden=1024, vocab_size=32000)
    settings = PlanSettings(micro_batch_size=16, accumulation=1, blocks=("recompute",) * 4, flavor="full",
                            chunked_loss=True, optimizer="device", distribution="fsdp2", compile=False,
                            precision="bf16-mixed")
    common = dict(seq_len=512, global_batch_size=16 * world, world_size=world, device_profile=H100)
    full = plan(config, budget=None, fsdp=True, settings=settings, **common)
    (composed,) = predictions(config, [settings], **common)
    assert "backward of model.layers" in full.report.peak_phase, full.report.peak_phase  # the blocks' backward
    assert abs(full.peak_bytes - composed.peak_bytes) <= MiB, (full.peak_bytes / MiB, composed.peak_bytes / MiB)


@pytest.mark.parametrize(("distribution", "step", "expected"),
                         [("fsdp2", 90, 125.0), ("ddp", 90, 105.0), ("fsdp2", 160, 130.0)])
def test_a_ranks_peak_takes_off_the_root_gradients_share_only_after_backward_under_fsdp2(
        monkeypatch, distribution, step, expected):
    """``rank_peak`` on a one-process trace of three backward runs (the head's, then two blocks'), 2 ranks: each
    run's peak less the half of the gradients that landed before it, under FSDP2 only the blocks' (the root
    reduce-scatters at the end of backward), under DDP all of them; the step's less the half of every gradient.
    Head 100 (40 of gradients), block 1 120 (10), block 0 130 (10), the step 90: FSDP2's peak is block 0's
    130 - 10/2 = 125, DDP's 130 - 50/2 = 105 (and 105 under FSDP2 before the fix). A step of 160 sets the peak at
    160 - 60/2 = 130, the root's half off too. Runs on every torch: the composition test above needs
    F.linear_cross_entropy. (The shifts every moment has are zeroed here.)"""
    from types import SimpleNamespace

    from memtrain.planner import cost

    monkeypatch.setattr(cost, "gradient_shard", lambda ctx, s: 0.5)
    monkeypatch.setattr(cost, "_distributed_shift", lambda ctx, prof, s: 0.0)
    monkeypatch.setattr(cost, "weights_shift", lambda prof, s: 0.0)
    monkeypatch.setattr(cost, "step_temp_after_backward", lambda s, temp: temp)

    def run(label: str, peak: int, grads: int, end: int) -> SimpleNamespace:
        return SimpleNamespace(label=label, peak_bytes=peak, gradient_bytes=grads, end_bytes=end)

    runs = [run("lm_head", 100, 40, 95), run("layers.1", 120, 10, 92), run("layers.0", 130, 10, step)]
    trace = SimpleNamespace(runs=runs, step_temp_bytes=0, report=SimpleNamespace(peak_bytes=max(130, step)))
    ctx = SimpleNamespace(block_names=("layers.0", "layers.1"))
    s = SimpleNamespace(distribution=distribution)
    assert cost.rank_peak(ctx, None, s, trace) == expected


def _root_gradient_worker(rank: int, init_file: str, results: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
                                    torch.nn.Linear(16, 64))
        for block in model[1:3]:
            fully_shard(block)
        fully_shard(model)  # the root: the embeddings and the head
        seen = {}

        def held(grad: torch.Tensor | None) -> tuple[int, ...] | None:
            """The shape of what this rank holds of a gradient: a DTensor's local shard (its .shape is global)."""
            return None if grad is None else tuple(getattr(grad, "to_local", lambda: grad)().shape)

        def in_first_blocks_backward(*_):
            seen["head"], seen["block"] = held(model[3].weight.grad), held(model[2].weight.grad)

        model[1].register_full_backward_hook(in_first_blocks_backward)
        model(torch.randint(0, 64, (4, 8))).sum().backward()
        seen["head after"] = held(model[3].weight.grad)
        results[rank] = seen
    finally:
        dist.destroy_process_group()


def test_fsdp2_keeps_the_roots_gradient_unsharded_through_the_blocks_backward(tmp_path):
    """What ``rank_peak`` assumes of FSDP2 (2 processes, gloo): in the first block's backward, the last to run, the
    head's gradient (the root's) is whole (64 x 16) while the later block's is a shard already (8 x 16); after
    backward the head's is a shard too."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_root_gradient_worker, args=(str(tmp_path / "init"), results), nprocs=2, join=True)
    for rank in (0, 1):
        assert results[rank] == {"head": (64, 16), "block": (8, 16), "head after": (32, 16)}, results[rank]


@pytest.mark.parametrize("precision, gathered_bytes", [("bf16-mixed", 2), ("fp32", 4)])
def test_fsdp2_gathers_blocks_in_bf16_under_bf16_mixed(precision, gathered_bytes):
    """A rank holds its shard of the weights and AdamW's state, two blocks gathered whole (the one computing, the
    next one prefetched) and the root's parameters (embeddings, last norm, head) gathered from its forward to the end
    of backward (the root does not reshard after forward): in bf16 under bf16-mixed (FSDP2's MixedPrecisionPolicy),
    2 bytes a parameter."""
    from memtrain.planner.tracing import state_bytes

    config = planner_llama(layers=4, hidden=256, vocab_size=1024)
    model = meta_model(config)
    blocks = [f"model.layers.{i}" for i in range(4)]
    world = 4
    # Accumulation keeps FSDP2's gradients unsharded: the whole difference is the shift of every moment.
    settings = PlanSettings(micro_batch_size=1, accumulation=2, blocks=("recompute",) * 4, flavor="full",
                            chunked_loss=False, optimizer="device", distribution="fsdp2", compile=False,
                            precision=precision)
    ranks, one = _per_rank_and_one_process(config, settings, world)
    state = state_bytes(model, blocks, None, cuda=True)
    block_numel = max(sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks)
    root_numel = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for b in blocks for p in model.get_submodule(b).parameters())
    expected = (-(state["parameters"] + state["state"]) * (1 - 1 / world)
                + gathered_bytes * (2 * block_numel + root_numel))
    assert ranks.peak_bytes - one.peak_bytes == pytest.approx(expected, abs=1), (
        (ranks.peak_bytes - one.peak_bytes) / MiB, expected / MiB)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fsdp2_with_the_optimizer_offloaded_keeps_every_shard_in_host_ram(accumulation):
    """FSDP2's host offload (CPUOffloadPolicy): the device holds no parameter and no state, only two blocks and the
    root gathered in bf16, the root's gradients until the end of backward (and, while a window accumulates, the
    unsharded fp32 gradients); each rank's host RAM holds
    its shard of the fp32 weights, of their fp32 gradients and of AdamW's moments; per micro-batch each rank copies
    its fp32 shard of every block in forward and again in backward and the root's once, and its gradients' shard
    once a step."""
    from memtrain.planner import predictions

    config = planner_llama(layers=4, hidden=256, vocab_size=1024)
    model = meta_model(config)
    blocks = [f"model.layers.{i}" for i in range(4)]
    numel = sum(p.numel() for p in model.parameters())
    block_numel = [sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks]
    root_numel = numel - sum(block_numel)
    world = 4
    host = PlanSettings(micro_batch_size=1, accumulation=accumulation, blocks=("recompute",) * 4, flavor="full",
                        chunked_loss=False, optimizer="offload", distribution="fsdp2", compile=False,
                        precision="bf16-mixed", offload_weights=True)
    ranks, _ = _per_rank_and_one_process(config, host, world)
    # One process of the same optimizer with its weights on the device (its own parameter offload streams them).
    one = plan(config, budget=None, seq_len=64, device_profile=H100, precision=host.precision,
               global_batch_size=accumulation,
               settings=dataclasses.replace(host, distribution="none", offload_weights=False))
    # The root's gradients (bf16, then an fp32 reduce-scatter input beside them) wait for the end of backward.
    expected = (-4 * numel + 2 * (2 * max(block_numel) + root_numel) + (2 + 4) * root_numel
                + (4 * numel if accumulation > 1 else 0))
    assert ranks.peak_bytes - one.peak_bytes == pytest.approx(expected, abs=1), (
        (ranks.peak_bytes - one.peak_bytes) / MiB, expected / MiB)
    (c,) = predictions(config, [host], seq_len=64, global_batch_size=world * accumulation, device="cuda",
                       world_size=world, device_profile=H100)
    link = c.host_link
    assert link.weights_to_device == 4 * (2 * sum(block_numel) + root_numel) / world * accumulation
    assert link.optimizer_to_host == 4 * numel / world and link.optimizer_to_device == 0, link
    # Host RAM: 4 + 4 + 8 bytes a parameter over the ranks (and the step counters), for each rank of the node; the
    # weights' and gradients' shards pinned, each rounded up to a power of two by torch's host allocator.
    pinned = sum(1 << (-(-p.numel() // world) * 4 - 1).bit_length() for p in model.parameters())
    optimizer_host = c.host_bytes / min(world, 8) - 2 * pinned - 8 * numel / world
    assert 0 <= optimizer_host < 4 * MiB, optimizer_host / MiB  # the loader's pinned batches, the counters


def test_fsdp2_all_gathers_in_bf16_and_reduce_scatters_in_fp32():
    """Link time of a step on a slow interconnect: two all-gathers of the weights (bf16 under bf16-mixed) and one
    reduce-scatter of the fp32 gradients, per rank's share; halving the link speed adds exactly that much again."""
    config = planner_llama(layers=4, hidden=256, vocab_size=1024)
    numel = sum(p.numel() for p in meta_model(config).parameters())
    world, acc = 4, 1
    settings = PlanSettings(micro_batch_size=1, accumulation=acc, blocks=("keep",) * 4, flavor="full",
                            chunked_loss=False, optimizer="device", distribution="fsdp2", compile=False,
                            precision="bf16-mixed")
    seconds = {}
    for link in (1e6, 2e6):  # bytes/s: so slow that no compute hides the collectives
        profile = dataclasses.replace(H100, interconnect=link)
        seconds[link] = plan(config, budget=None, seq_len=64, global_batch_size=world, world_size=world, fsdp=True,
                             settings=settings, device_profile=profile).step_seconds
    share = (world - 1) / world
    link_bytes = (2 * 2 * numel * acc + 4 * numel) * share  # 2 bf16 all-gathers + 1 fp32 reduce-scatter
    added = seconds[1e6] - seconds[2e6]  # the link time at 1e6 B/s less that at 2e6 B/s: half of it at 1e6
    assert added == pytest.approx(link_bytes / 2e6, rel=1e-6), (added, link_bytes / 2e6)


def test_ddp_gradients_are_its_buckets():
    """Under DDP each gradient is a view into its all-reduce bucket (gradient_as_bucket_view=True): the buckets
    exist from the start, but the step holds one copy of the gradients, not two. While accumulating (and at the
    first window, before the views exist) the earlier micro-batches' gradients are tensors of their own beside the
    buckets; an offloaded optimizer keeps them on the device until the step under DDP."""
    config = planner_llama(layers=4, hidden=256, vocab_size=1024)
    grads = 4 * sum(p.numel() for p in meta_model(config).parameters())
    # All blocks recomputed, 64 tokens: the step (every gradient alive) is the one-process peak.
    for optimizer, acc, expected in (("device", 1, 0), ("device", 2, grads), ("offload", 1, grads),
                                     ("offload", 2, 2 * grads)):
        settings = PlanSettings(micro_batch_size=1, accumulation=acc, blocks=("recompute",) * 4, flavor="full",
                                chunked_loss=False, optimizer=optimizer, distribution="ddp", compile=False,
                                precision="bf16-mixed")
        ranks, one = _per_rank_and_one_process(config, settings, 2)
        extra = ranks.peak_bytes - one.peak_bytes
        if expected:
            assert extra == expected, (optimizer, acc, extra / MiB, expected / MiB)
        else:  # the buckets exist in forward too, and the head's gradient counts beside them until the step
            assert 0 <= extra < grads / 2, (optimizer, acc, extra / MiB, grads / MiB)


@pytest.mark.parametrize("micro", [1, 4])
def test_host_link_of_offloaded_activations_is_what_the_offloader_moves_at_that_micro_batch(micro):
    from memtrain.estimate import trace
    from memtrain.offload import MIN_BYTES_DEFAULT

    model = _offload_gpt()
    s = PlanSettings(micro_batch_size=micro, accumulation=2, blocks=("offload", "offload"), flavor="full",
                     chunked_loss=False, optimizer="device", distribution="none", compile=False, precision="fp32")
    (c,) = predictions(model, [s], seq_len=256, global_batch_size=2 * micro, device="cuda", device_profile=H100)
    # The full estimate's simulated offloader, with the real one's threshold, at the candidate's micro-batch.
    t = trace(model, (micro, 256), device="cuda", precision="fp32",
              checkpointing={"policies": dict.fromkeys(("blocks.0", "blocks.1"), "offload")},
              offload_min_bytes=MIN_BYTES_DEFAULT)
    assert t.offloaded_bytes > 0
    # On the host: the offloader's pool in whole pinned slabs, and the data loader's pinned batches.
    pool = -(-t.offloaded_bytes // SLAB_BYTES_DEFAULT) * SLAB_BYTES_DEFAULT
    assert c.host_bytes == pool + loader_host_bytes(_cuda_problem(micro), micro), (c.host_bytes, t.offloaded_bytes)
    link = c.host_link
    assert (link.activations_to_host, link.activations_to_device) == (2 * t.offloaded_bytes,) * 2, link
    assert (link.optimizer_to_host, link.optimizer_to_device) == (0, 0), link


def test_host_link_of_an_offloaded_optimizer_is_its_gradients_each_micro_batch_and_the_weights_once():
    model = planner_gpt(2)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    s = PlanSettings(micro_batch_size=1, accumulation=3, blocks=("keep", "keep"), flavor="full",
                     chunked_loss=False, optimizer="offload", distribution="none", compile=False, precision="fp32")
    (c,) = predictions(model, [s], seq_len=32, global_batch_size=3, device="cuda", device_profile=H100)
    assert c.host_link.to_dict() == {"activations_to_host": 0, "activations_to_device": 0,
                                     "optimizer_to_host": 3 * 4 * numel, "optimizer_to_device": 4 * numel,
                                     "weights_to_device": 0, "to_host": 12 * numel, "to_device": 4 * numel, "total": 16 * numel}


def test_compiled_offloading_set_ups_time_the_code_around_the_blocks_eager(llama):
    # compile_model compiles an offloading set-up block by block: the embeddings, the head and the loss stay eager,
    # so compiling saves such a set-up its blocks' time only; a set-up without offload is compiled whole. With an
    # unlimited host link nothing waits on copies: the step is the blocks' time plus the rest's.
    from memtrain.planner.search import composer_for, problem_of

    fast_link = dataclasses.replace(H100, host_to_device=1e30, device_to_host=1e30)
    settings = {(kind, compiled): PlanSettings(micro_batch_size=2, accumulation=1, blocks=(kind,) * 4,
                                               flavor="full", chunked_loss=False, optimizer="device",
                                               distribution="none", compile=compiled,
                                               precision="bf16-mixed")
                for kind in ("keep", "offload") for compiled in (False, True)}
    seconds = {k: c.step_seconds for k, c in zip(settings, predictions(
        llama, list(settings.values()), seq_len=512, global_batch_size=2, device_profile=fast_link), strict=True)}
    ctx = problem_of(llama, 512, 2, "cuda", "bf16-mixed", 1, True, True, fast_link)
    composer = composer_for(ctx, list(settings.values()))
    prof = composer.profile("device")

    def blocks_s(kind, compiled):
        a = composer.arrays(prof, kind, 2, compiled)
        return float(a.forward_s.sum() + a.backward_s.sum())

    for kind in ("keep", "offload"):
        gain = seconds[kind, False] - seconds[kind, True]
        blocks_gain = blocks_s(kind, False) - blocks_s(kind, True)
        if kind == "offload":
            assert gain == pytest.approx(blocks_gain, rel=1e-9), (gain, blocks_gain)
        else:  # compiled whole: the code around the blocks gains too
            assert gain > blocks_gain * (1 + 1e-6), (gain, blocks_gain)
    p = plan(llama, budget=None, seq_len=512, global_batch_size=2, device_profile=H100,
             settings=settings["offload", True])
    assert any("compile_model" in a and "eager" in a for a in p.assumptions), p.assumptions


def _cuda_problem(micro: int):
    from memtrain.planner.search import problem_of

    return problem_of(_offload_gpt(), 256, micro, "cuda", "fp32", 1, True, True, H100)


def test_host_figure_of_offloaded_activations_is_the_pool_the_built_offloader_pins():
    """The plan's host bytes are what the offloader really holds: its slabs, whole (HostPool pins slab by slab), not
    the bytes the activations take (before: 2.0 MiB against the 128 MiB slab pinned); beside them the data
    loader's allowance (pinned batches: CUDA only, so not measured here)."""
    from offload_stream_model import FakeTransport

    from memtrain.checkpointing import apply_checkpointing
    from memtrain.offload import MIN_BYTES_DEFAULT, ActivationOffloader

    micro = 4
    model = _offload_gpt()
    s = PlanSettings(micro_batch_size=micro, accumulation=1, blocks=("offload", "offload"), flavor="full",
                     chunked_loss=False, optimizer="device", distribution="none", compile=False, precision="fp32")
    (c,) = predictions(model, [s], seq_len=256, global_batch_size=micro, device="cuda", device_profile=H100)
    off = ActivationOffloader(FakeTransport(lag=1), min_bytes=MIN_BYTES_DEFAULT)  # apply_plan's: the free RAM's half
    apply_checkpointing(model, policies={"blocks.0": "offload", "blocks.1": "offload"}, offloader=off)
    x = torch.randint(0, 256, (micro, 256))
    model(x, x).backward()
    stats = off.stats()
    assert 0 < stats.host_peak_used_bytes < stats.host_reserved_bytes, stats
    loader = loader_host_bytes(_cuda_problem(micro), micro)
    assert c.host_bytes - loader == stats.host_reserved_bytes, (c.host_bytes, loader, stats)
    assert loader == 2 * 2 * micro * 256 * 8, loader  # two batches of inputs and labels, powers of two already


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_the_host_step_of_an_offloaded_optimizer_runs_at_its_moments_rate(state):
    # The host's AdamW with lean moments is slower than fused fp32 AdamW (memtrain.optim.cpu_step_rate: bf16 about
    # 3x, bitsandbytes' int8 about 16-30x on a CPU): the offloaded step's time takes the rate of its moments.
    from memtrain.techniques.optimizer.cost import _CPU_RATE

    model = planner_gpt(2)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    profile = dataclasses.replace(H100, cpu_adamw=1e6, cpu_adamw_bf16=None, cpu_adamw_int8=None)  # the host dominates
    fp32, lean = (PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep", "keep"), flavor="full",
                               chunked_loss=False, optimizer="offload", distribution="none", compile=False,
                               precision="fp32",
                               state_precision=s) for s in ("fp32", state))
    c32, cl = predictions(model, [fp32, lean], seq_len=32, global_batch_size=1, device="cuda", device_profile=profile)
    slower = numel / (1e6 * _CPU_RATE[state]) - numel / 1e6
    assert cl.step_seconds - c32.step_seconds == pytest.approx(slower, rel=0.05), (c32.step_seconds, cl.step_seconds)


@pytest.mark.parametrize("quantize", [None, "nf4"], ids=["lora", "qlora"])
def test_fsdp2_gathers_a_lora_models_frozen_base_block_by_block(quantize):
    """FSDP2 gathers every parameter of a group, frozen ones too: a LoRA model's rank holds two blocks' base weights
    and the root's gathered (in bf16, a 4-bit layer's packed codes as stored), not its whole frozen base as the root
    (the gathered bytes were once counted from the trainable adapters alone). A 4-bit layer's scales are no
    parameter of bitsandbytes': every rank keeps them whole."""
    import argparse

    pytest.importorskip("peft")
    from memtrain.cli.workloads import with_lora
    from memtrain.planner.tracing import state_bytes
    from memtrain.quantize import Linear4bitStandIn

    config = planner_llama(layers=4, hidden=256, vocab_size=1024)
    args = argparse.Namespace(lora=8, lora_alpha=16, lora_dropout=0.0, lora_targets=None, quantize_base=quantize)
    world = 4
    settings = PlanSettings(micro_batch_size=1, accumulation=2, blocks=("recompute",) * 4, flavor="full",
                            chunked_loss=False, optimizer="device", distribution="fsdp2", compile=False,
                            precision="bf16-mixed")
    common = dict(budget=None, seq_len=64, device_profile=H100, precision="bf16-mixed")
    ranks = plan(with_lora(meta_model(config), args, "bf16-mixed"), global_batch_size=2 * world,
                 world_size=world, fsdp=True, settings=settings, **common)
    one = plan(with_lora(meta_model(config), args, "bf16-mixed"), global_batch_size=2,
               settings=dataclasses.replace(settings, distribution="none"), **common)

    model = with_lora(meta_model(config), args, "bf16-mixed")
    scales = {id(p) for m in model.modules() if isinstance(m, Linear4bitStandIn) for p in (m.absmax, m.code)}
    assert bool(scales) == bool(quantize)

    def gathered(module):  # bytes as FSDP2 gathers them: floats in bf16, the packed codes as stored
        return sum(p.numel() * (2 if p.is_floating_point() else p.element_size()) for p in module.parameters()
                   if id(p) not in scales)

    def stored(params):
        return sum(p.numel() * p.element_size() for p in params)

    blocks = [model.get_submodule(f"base_model.model.model.layers.{i}") for i in range(4)]
    root = gathered(model) - sum(gathered(b) for b in blocks)
    trainable = [p for p in model.parameters() if p.requires_grad]
    sharded = stored(p for p in model.parameters() if id(p) not in scales)
    # AdamW's two fp32 moments of the adapters and their step counters, as the allocator rounds them.
    state = state_bytes(model, [], None, cuda=True)["state"]
    assert state >= 8 * sum(p.numel() for p in trainable)
    expected = -(sharded + state) * (1 - 1 / world) + 2 * max(gathered(b) for b in blocks) + root
    assert ranks.peak_bytes - one.peak_bytes == pytest.approx(expected, abs=1024), (
        (ranks.peak_bytes - one.peak_bytes) / MiB, expected / MiB)
    # The old count (blocks' bytes from their trainable adapters, the root everything else, every byte sharded) is
    # far from it: the check can fail.
    adapters = [stored(p for p in b.parameters() if p.requires_grad) for b in blocks]
    old = (-(stored(model.parameters()) + state) * (1 - 1 / world)
           + (2 * max(adapters) + stored(model.parameters()) - sum(adapters)) / 2)
    assert abs(old - expected) > 100 * 1024, (old / MiB, expected / MiB)


def test_full_estimates_carry_what_they_showed_to_the_composed_rows():
    """``FullEstimates``: a full estimate says what composition missed for its shape of candidate (its configuration,
    with or without offloaded blocks) and what the allocator's segments need beyond its peak. Every composed row of
    that shape carries the first, every composed row the second (the most seen), as the budget less the margin sees
    it; a row estimated in full is its own figures; ``fitting_all`` is ``fitting`` row by row."""
    from types import SimpleNamespace

    from memtrain.planner.cost import CandidateTable, FullEstimates
    from memtrain.planner.settings import Configuration

    a, b = (Configuration(micro_batch_size=m, accumulation=1, flavor="full", distribution="none") for m in (1, 2))
    table = CandidateTable(n_blocks=2)
    table.add(a, 0, np.array([0, 1]), np.array([100.0, 90.0]) * MiB, np.zeros(2), np.array([1.0, 1.1]))
    table.add(a, 1, np.array([1]), np.array([85.0]) * MiB, np.zeros(1), np.array([1.2]))
    table.add(b, 0, np.array([2]), np.array([80.0]) * MiB, np.zeros(1), np.array([1.3]))
    table.finish()
    estimates = FullEstimates(table, margin=0.05)
    assert [estimates.peak(k) for k in range(4)] == [m * MiB for m in (100, 90, 85, 80)]  # nothing seen yet

    def trace(peak: float, needed: float) -> SimpleNamespace:
        return SimpleNamespace(report=SimpleNamespace(peak_bytes=peak, needed_bytes=needed))

    # Row 0 comes out 10 MiB over its composed peak; its segments need 20 MiB beyond it.
    assert estimates.add(0, 110.0 * MiB, trace(110.0 * MiB, 130.0 * MiB)) == math.floor(130 * MiB * 0.95)
    assert 0 in estimates and len(estimates) == 1
    # Row 1, its shape: 10 MiB missed; row 2 offloads a block (another shape); row 3 another configuration.
    assert [estimates.peak(k) for k in range(4)] == [m * MiB for m in (110, 100, 85, 80)]
    expected = [math.floor(130 * MiB * 0.95)] + [max(p, math.floor((p + 20 * MiB) * 0.95))
                                                 for p in (100 * MiB, 85 * MiB, 80 * MiB)]
    assert [estimates.fitting(k) for k in range(4)] == expected
    assert estimates.fitting_all().tolist() == expected
    no_budget = FullEstimates(table, margin=None)
    no_budget.add(0, 110.0 * MiB, trace(110.0 * MiB, 130.0 * MiB))
    assert no_budget.fitting_all().tolist() == [m * MiB for m in (110, 100, 85, 80)]
