"""``apply_plan``: configures a model in place as a plan says, places it on the device part by part as the plan does,
and builds its optimizer and accumulator, as an ordered tuple of stages (``STAGES``), one per technique, each named
after it and keyed by its name in ``memtrain.techniques.REGISTRY``. The only part of the planner that imports the
techniques.

The order is the techniques' constraints on each other (each stage's docstring says why it sits where it does):
checkpointing, the chunked loss, the tiled MLP and the KV cache (the model's stages, ``MODEL_STAGES``, which a re-plan runs again
through ``configure_model``); pure bf16's cast and the offloaded optimizer (which takes its fp32 master from the host
weights) before the placement; the placement; parameter offload (from that optimizer's host weights); DDP or FSDP2
(which places while it shards); ``torch.compile`` over the wrapped module; a device optimizer over the parameters as
they are then (FSDP2's shards); the accumulator over both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from memtrain import techniques
from memtrain.accumulation import GradientAccumulator
from memtrain.checkpointing import compile_model, find_blocks
from memtrain.device import Accelerator, accelerator
from memtrain.errors import ConfigError
from memtrain.loss import apply_chunked_loss, remove_chunked_loss
from memtrain.message import arg, marked
from memtrain.offload import WeightStreamer
from memtrain.optim import CPUOffloadOptimizer, build_optimizer
from memtrain.planner.checks import SETTINGS_TERMS, setup_of
from memtrain.planner.cost import fsdp2_param_dtype
from memtrain.planner.settings import Plan, PlanSettings
from memtrain.precision import MixedPrecision
from memtrain.techniques import problems as rule_problems
from memtrain.techniques.distribution import shards_on_host
from memtrain.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp


# -- apply_plan ---------------------------------------------------------------------------------------------
@dataclass
class AppliedPlan:
    """What ``apply_plan`` set up: the model (configured in place), the module the loop calls (wrapped for
    DDP/FSDP2 and compiled as planned), the optimizer, the accumulator and the precision."""

    settings: PlanSettings
    model: nn.Module
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    accumulator: Any  # GradientAccumulator
    precision: Any  # MixedPrecision
    blocks: list[str] = field(default_factory=list)
    weights: WeightStreamer | None = None  # parameter offload: the blocks' weights streamed from the host


def apply_plan(model: nn.Module, plan: Plan | PlanSettings, *, lr: float = 3e-4,
               betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
               max_grad_norm: float | None = 1.0,
               scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
               device: torch.device | str | None = None) -> AppliedPlan:
    """Configures ``model`` in place as ``plan`` says, places it on ``device`` as the plan does and builds the
    optimizer and accumulator it asks for: runs ``STAGES`` in order (the module's docstring says the order and
    why), each of which returns at once where the plan does not use its technique. The plan is checked against the
    model and the process group first, so a plan that does not apply leaves the model as it was.

    Build (or load) the model on the CPU and pass ``device``: the device then never holds more of it than the plan
    does (a model moved to the device first holds all of its fp32 weights there before any plan applies).

    Args:
        model: the model the plan was made for, on the CPU (or already on ``device``).
        plan: from ``plan(...)``.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (a named class gets those it takes, in the same
            form: ``NamedOptimizer.hyperparameters``).
        max_grad_norm: clipping in the accumulator's step (None: none).
        scheduler: builds an LR scheduler from the optimizer (e.g. ``lambda o: LambdaLR(o, f)``).
        device: where the model trains (None: where its first parameter is). Under a simulated device
            (``MEMTRAIN_SIMULATED_DEVICE``) the CPU is that device, and every placement is counted against it.

    Raises:
        ConfigError: the model does not match the plan (other blocks), the plan needs torch.distributed
            initialised with ``plan.world_size`` ranks, or a rule between its techniques refuses it (a hand-made
            ``PlanSettings``: a plan's own never breaks one).
    """
    s = plan.settings if isinstance(plan, Plan) else plan
    names = _check_blocks(model, s, plan.block_names if isinstance(plan, Plan) else None)
    acc = accelerator(torch.device(device) if device is not None else next(model.parameters()).device)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    # FSDP2 takes a group of one rank too (its host offload on the one GPU there is: the device check's case).
    one_rank_fsdp2 = s.distribution == "fsdp2" and torch.distributed.is_initialized()
    if (s.distribution == "none") != (world == 1) and not one_rank_fsdp2:
        raise ConfigError(f"apply_plan: the plan's distribution is {s.distribution!r}, and this process group has "
                          f"{world} rank(s). To resolve this error, plan with {arg('world_size')} equal to torchrun's "
                          "--nproc_per_node.")
    # A hand-made set-up is held to the rules a plan obeys: e.g. compiled with streamed weights, it would fail only
    # at the first step, inside torch.compile.
    refused = rule_problems(setup_of(s, world, s.precision), SETTINGS_TERMS)
    ConfigError.raise_if(f"apply_plan: {marked(p)}" for p in refused)
    precision = MixedPrecision(s.precision, acc.device.type)  # type: ignore[arg-type]
    a = Applying(model, s, names, acc=acc, precision=precision, world=world,
                 hyper={"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
                 max_grad_norm=max_grad_norm, scheduler=scheduler)
    for stage in STAGES:
        stage.run(a)
    return AppliedPlan(settings=s, model=model, train_model=a.train_model, optimizer=a.optimizer,
                       accumulator=a.accumulator, precision=a.precision, blocks=a.wrapped, weights=a.weights)


def configure_model(model: nn.Module, settings: PlanSettings) -> list[str]:
    """The model's part of ``apply_plan`` (``MODEL_STAGES``), in place: checkpointing per block (recompute /
    offload, the flavor), the chunked loss, the tiled MLP, no KV cache. Undoes what an earlier plan set, so a re-plan calls it
    again. Returns the wrapped blocks' names.

    Raises:
        ConfigError: the model's blocks are not the plan's.
    """
    a = Applying(model, settings, _check_blocks(model, settings, None))
    for stage in MODEL_STAGES:
        stage.run(a)
    return a.wrapped


# -- what the stages share ------------------------------------------------------------------------------------
@dataclass
class Applying:
    """One ``apply_plan`` under way: what the stages are given, and what they produce for the next ones.

    ``configure_model`` runs the model's stages alone: they read only ``model``, ``settings`` and ``names`` (the
    others are None there, so a stage that read them would fail at once).
    """

    model: nn.Module
    settings: PlanSettings
    names: list[str]  # the model's blocks, in order (the plan's)
    acc: Accelerator | None = None  # where the model trains
    precision: MixedPrecision | None = None
    world: int = 1  # ranks of the process group (1: none)
    hyper: dict[str, Any] = field(default_factory=dict)  # AdamW's: lr, betas, eps, weight_decay
    max_grad_norm: float | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    # What the stages produce
    wrapped: list[str] = field(default_factory=list)  # the blocks checkpointing wrapped
    optimizer: torch.optim.Optimizer | None = None
    weights: WeightStreamer | None = None
    train_model: nn.Module | None = None  # the module the loop calls: the model, wrapped for DDP and compiled
    accumulator: GradientAccumulator | None = None

    def __post_init__(self) -> None:
        self.train_model = self.train_model or self.model

    @property
    def device(self) -> torch.device:
        assert self.acc is not None, "a model stage read the device: only apply_plan's later stages have one"
        return self.acc.device


class Stage(NamedTuple):
    """One step of ``apply_plan``: ``technique`` is the name of the technique it applies in
    ``memtrain.techniques.REGISTRY`` (or one of ``NOT_TECHNIQUES``), ``run`` does it."""

    technique: str
    run: Callable[[Applying], None]


# The stages that are no technique's (each stage's docstring says why it is one).
NOT_TECHNIQUES = frozenset({"placement", "KV cache"})
# The techniques another technique's stage applies (its docstring says how).
APPLIED_BY = {"activation offload": "activation checkpointing"}


# -- the model's stages: what a re-plan sets again -------------------------------------------------------------
def activation_checkpointing(a: Applying) -> None:
    """Wraps each block as its kind says (recompute, or offload its saved activations: activation offload), the
    recomputed ones in the plan's flavor (full, selective, or their inputs offloaded), undoing an earlier plan's
    wrappers first: the plan's policy as a user writes it (its part of ``settings.choices``, a ``Checkpointing``; the
    other techniques' rules are apply_plan's to check), applied as a user's is. First: the blocks are wrapped
    before anything compiles or shards them."""
    if a.settings.blocks:  # no blocks detected: checkpointing the user applied by hand stays
        a.wrapped = techniques.checkpointing.TECHNIQUE.chosen(a.settings)["checkpointing"].apply(a.model)


def chunked_loss(a: Applying) -> None:
    """The loss computed in chunks of the sequence (no whole logits tensor), or the model's own again. A model
    stage: before the model is wrapped or compiled, so that they take the chunked head as it is."""
    remove_chunked_loss(a.model)
    if a.settings.chunked_loss:
        apply_chunked_loss(a.model)


def tiled_mlp(a: Applying) -> None:
    """Each block's MLP over tiles of tokens, or whole again. A model stage: before the model is wrapped, sharded
    or compiled (the blocks' own MLPs are tiled, whichever wrapper calls them)."""
    remove_tiled_mlp(a.model)
    if a.settings.tiled_mlp:
        apply_tiled_mlp(a.model)


def kv_cache_off(a: Applying) -> None:
    """Turns the model's KV cache off (``config.use_cache``): it only holds memory in training, and the plan's
    estimate has none. A model stage, so a re-plan's model has it off too."""
    config = getattr(a.model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


# -- the device's stages, in their order ------------------------------------------------------------------------
def pure_bf16(a: Applying) -> None:
    """Pure bf16: the weights themselves become bf16 (no fp32 master anywhere; buffers keep their dtype). Before
    the offloaded optimizer, which then keeps no master, and before the placement: the device never holds them in
    fp32."""
    if not a.settings.pure_bf16:
        return
    for p in a.model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)


def offloaded_optimizer(a: Applying) -> None:
    """The offloaded optimizer (``CPUOffloadOptimizer``: fp32 master, state and step in host RAM) over the
    parameters that require grad. Before the placement: it takes the master's full digits from the host weights,
    then makes the device copies bf16 where the plan says (offload-bf16-weights), so that the device never holds
    them in fp32; and before DDP, which buckets the weights as they are then."""
    s = a.settings
    if s.optimizer == "device" or shards_on_host(s):
        return
    # NOTE: under DDP, gradients stay on the device until the step: DDP averages them after the hooks that would
    # have copied them to the host. In one process they stream to the host during backward.
    bf16 = torch.bfloat16 if s.optimizer == "offload-bf16-weights" else None
    # NOTE: frozen weights (a LoRA model's base) have no master to keep: bf16 on the device too, as the plan
    # estimated every weight on the device (estimate(weights_dtype="bf16")).
    for p in a.model.parameters() if bf16 is not None else ():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(bf16)
    named, hyper = s.optimizer_class, a.hyper
    if not named.is_adamw:  # the run's own class on the host: the run's hyper-parameters it takes, its kwargs
        named.state_sizes((1,), torch.float32)  # a class that cannot step on the host: one clear error, now
        hyper = {"optimizer_class": named.resolve(), **named.hyperparameters(**hyper)}
    a.optimizer = CPUOffloadOptimizer(_trainable(a.model), offload_gradients=a.world == 1,
                                      grad_scaler=a.precision.scaler, device_dtype=bf16,
                                      state_precision=s.state_precision, pure_bf16=s.pure_bf16, device=a.device,
                                      **hyper)


def placement(a: Applying) -> None:
    """Every parameter and buffer on the device once, in the dtype the stages before gave it (``place_model``), but
    the blocks' weights parameter offload streams. After pure bf16's cast and the offloaded optimizer's; before DDP,
    which broadcasts the device weights. Under FSDP2 nothing: ``fully_shard`` places each block as it shards it."""
    if a.settings.distribution == "fsdp2":
        return
    place_model(a.model, a.acc, leave=streamed_params(a.model, a.names) if a.settings.offload_weights else [])


def parameter_offload(a: Applying) -> None:
    """Parameter offload: the blocks' weights stream from the offloaded optimizer's host weights (``stream_weights``),
    which therefore comes first; after the placement, which left them in host memory."""
    if a.settings.offload_weights and not shards_on_host(a.settings):
        a.weights = stream_weights(a.model, a.names, a.optimizer, a.device)


def data_parallelism(a: Applying) -> None:
    """FSDP2 (each block sharded, gathered in ``fsdp2_param_dtype``, gradients reduced in fp32; ``fully_shard``
    places each block as it shards it) or DDP (each gradient a view into its all-reduce bucket). After the
    placement and the offloaded optimizer (DDP wraps the weights as they are then, FSDP2 shards them); before
    ``torch.compile``, which compiles the wrapped module, and before a device optimizer, which holds FSDP2's shards."""
    s = a.settings
    if s.distribution == "fsdp2":
        # Imported here: only an FSDP2 run needs torch.distributed's FSDP (not every torch build has it).
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # bf16-mixed: blocks gathered (and computed) in bf16, gradients reduce-scattered in fp32 into the fp32
        # shards the optimizer steps; autocast still runs the fp32 ops (norms, softmax, the loss) in fp32.
        gathered = fsdp2_param_dtype(s.precision)
        policy = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32 if gathered else None)
        # The optimizer offloaded: each rank's shards (the fp32 master) and their gradients live in host RAM
        # (pinned where the device copies from it asynchronously), the step runs there (sharded_host_optimizer),
        # and each block is copied to the device and gathered as it runs.
        offload = CPUOffloadPolicy(pin_memory=a.acc.pins_host_memory) if shards_on_host(s) else OffloadPolicy()
        modules = dict(a.model.named_modules())
        for name in a.names:
            fully_shard(modules[name], mp_policy=policy, offload_policy=offload)
        fully_shard(a.model, mp_policy=policy, offload_policy=offload)
    elif s.distribution == "ddp":
        ids = [a.device.index] if a.acc.kind not in ("cpu", "simulated") else None
        # Each p.grad is a view into DDP's all-reduce bucket: one copy of the gradients, not two.
        a.train_model = nn.parallel.DistributedDataParallel(a.model, device_ids=ids, gradient_as_bucket_view=True)


def torch_compile(a: Applying) -> None:
    """``torch.compile`` of the module the loop calls: per block where blocks offload their activations (saved-tensor
    hooks cannot be traced), else whole. After the model's stages and the wrapping (DDP), which it compiles."""
    if a.settings.compile:
        a.train_model = compile_model(a.train_model)


def device_optimizer(a: Applying) -> None:
    """An optimizer on the device over the parameters that require grad: ``torch.optim.AdamW(fused=True)``, the
    run's named class, or ``build_optimizer``'s lean variants (low-precision moments, a share offloaded, step in
    backward, pure bf16). After FSDP2, whose sharded parameters it must hold."""
    s = a.settings
    if shards_on_host(s):
        sharded_host_optimizer(a)
        return
    if s.optimizer != "device":
        return
    trainable, named = _trainable(a.model), s.optimizer_class
    if s.state_precision == "fp32" and not (s.step_in_backward or s.offload_fraction or s.pure_bf16):
        if not named.is_adamw:  # the run's own class, as it comes
            a.optimizer = named.resolve()([p for _, p in trainable], **named.hyperparameters(**a.hyper))
        else:  # fused: one kernel per step (CUDA and CPU), and the same kernel CPUOffloadOptimizer runs on the host.
            a.optimizer = torch.optim.AdamW([p for _, p in trainable], fused=True, **a.hyper)
        return
    a.optimizer = build_optimizer(trainable, state_precision=s.state_precision, offload_fraction=s.offload_fraction,
                                  step_in_backward=s.step_in_backward, grad_scaler=a.precision.scaler,
                                  world_size=a.world, pure_bf16=s.pure_bf16, optimizer_class=named, **a.hyper)


def sharded_host_optimizer(a: Applying) -> None:
    """The optimizer over FSDP2's shards in host RAM (``CPUOffloadPolicy``): torch's fused AdamW on the CPU (the
    kernel the offloaded optimizer's host step runs for fp32 moments) or the run's named class, over each rank's
    shard of the fp32 master; the gradients arrive there reduce-scattered. Called by the device optimizer's stage:
    after FSDP2, whose shards it holds."""
    trainable, named = _trainable(a.model), a.settings.optimizer_class
    params = [p for _, p in trainable]
    if named.is_adamw:
        a.optimizer = torch.optim.AdamW(params, fused=True, **a.hyper)
    else:
        named.state_sizes((1,), torch.float32)  # a class that cannot step on the host: one clear error, now
        a.optimizer = named.resolve()(params, **named.hyperparameters(**a.hyper))


def gradient_accumulation(a: Applying) -> None:
    """The ``GradientAccumulator``: the plan's micro-batches per step, the precision's scaler, clipping and the
    scheduler. Last: it steps the optimizer over the module the loop calls, both final only now."""
    a.accumulator = GradientAccumulator(a.train_model, a.optimizer, steps=a.settings.accumulation,
                                        scaler=a.precision.scaler,
                                        scheduler=a.scheduler(a.optimizer) if a.scheduler is not None else None,
                                        max_grad_norm=a.max_grad_norm)


# What configure_model (a re-plan) runs, then the rest of apply_plan, in order. The optimizer has two stages: where it
# steps decides where it is built (its master from the host weights before the placement; a device one after FSDP2).
MODEL_STAGES: tuple[Stage, ...] = (
    Stage("activation checkpointing", activation_checkpointing),
    Stage("chunked loss", chunked_loss),
    Stage("tiled MLP", tiled_mlp),
    Stage("KV cache", kv_cache_off),
)
STAGES: tuple[Stage, ...] = (
    *MODEL_STAGES,
    Stage("pure bf16", pure_bf16),
    Stage("optimizer", offloaded_optimizer),
    Stage("placement", placement),
    Stage("parameter offload", parameter_offload),
    Stage("data parallelism", data_parallelism),
    Stage("torch.compile", torch_compile),
    Stage("optimizer", device_optimizer),
    Stage("gradient accumulation", gradient_accumulation),
)


# -- what the placement and parameter offload stages call ---------------------------------------------------
def place_model(model: nn.Module, acc: Accelerator, *, leave: list[nn.Parameter] = ()) -> None:
    """Places every parameter and buffer of ``model`` on ``acc``'s device once (``acc.place``), in the dtype it has
    now, but those in ``leave`` (streamed block weights: they stay in host memory). A tensor already there stays.
    Tied parameters are placed once and stay tied."""
    left = {id(p) for p in leave}
    placed: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in left and id(p) not in placed:
                p.data = placed[id(p)] = acc.place(p.data)
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in placed:
                    placed[id(b)] = acc.place(b)
                module._buffers[name] = placed[id(b)]


def streamed_params(model: nn.Module, blocks: list[str]) -> list[nn.Parameter]:
    """The parameters of the blocks parameter offload streams: in host memory at rest, never whole on the device."""
    modules = dict(model.named_modules())
    return list({id(p): p for name in blocks for p in modules[name].parameters()}.values())


def stream_weights(model: nn.Module, blocks: list[str], optimizer: Any,
                   device: torch.device | None = None) -> WeightStreamer:
    """Parameter offload for ``apply_plan``: the blocks' weights stream from ``optimizer``'s host master (or its bf16
    cast) to ``device`` (None: where the model's first parameter is), and its steps, which update them in place,
    wait for the streamer's fills issued before them (``wait_for_fills``).

    Raises:
        ConfigError: ``optimizer`` is not a ``CPUOffloadOptimizer`` (a plan of another placement).
    """
    if not isinstance(optimizer, CPUOffloadOptimizer):
        raise ConfigError(f"apply_plan: {arg('offload_weights', True)} needs the offloaded optimizer, whose host "
                          "master the blocks' weights stream from. To resolve this error, plan with optimizer "
                          "'offload'.")
    modules = dict(model.named_modules())
    params = [p for name in blocks for p in modules[name].parameters() if p.requires_grad]
    streamer = WeightStreamer(model, blocks=blocks, device=device, host_weights=optimizer.stream_weights(params))
    optimizer.wait_for_fills(streamer.fills_done)
    return streamer


def _check_blocks(model: nn.Module, s: PlanSettings, planned: tuple[str, ...] | None) -> list[str]:
    names = find_blocks(model)
    if len(names) != len(s.blocks) or (planned is not None and tuple(names) != planned):
        raise ConfigError(f"apply_plan: the model's {len(names)} blocks {names[:3]}... are not the plan's "
                          f"{len(s.blocks)} (made for another model). To resolve this error, plan this model.")
    return names


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters an optimizer steps, by name: those that require grad (a LoRA model's adapters)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
