"""``apply_plan``: configures a model in place as a plan says (checkpointing, the chunked loss, the optimizer's
placement, DDP/FSDP2, ``torch.compile``), places it on the device part by part as the plan does, and builds its
optimizer and accumulator. The only part of the planner that imports the techniques.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memtrain.accumulation import GradientAccumulator
from memtrain.checkpointing import apply_checkpointing, compile_model, find_blocks, remove_checkpointing
from memtrain.device import Accelerator, accelerator
from memtrain.errors import ConfigError
from memtrain.loss import apply_chunked_loss, remove_chunked_loss
from memtrain.offload import WeightStreamer
from memtrain.optim import CPUOffloadOptimizer, build_optimizer
from memtrain.planner.cost import fsdp2_param_dtype
from memtrain.planner.settings import Plan, PlanSettings
from memtrain.precision import MixedPrecision


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
    optimizer and accumulator it asks for.

    In order: checkpointing (per-block policies, selective, offloaded inputs), the chunked loss, pure bf16's cast,
    an offloaded optimizer (``CPUOffloadOptimizer``, which takes the fp32 master from the weights where they are
    and then makes the device weights bf16 where the plan says), the placement (``place_model``: every parameter
    and buffer once, in its device dtype, but the streamed blocks' weights), parameter offload (``WeightStreamer``,
    from that optimizer's host weights), DDP (each gradient a view into its all-reduce bucket) or FSDP2 (blocks
    gathered in ``fsdp2_param_dtype``, gradients reduced in fp32; ``fully_shard`` places each block as it shards
    it), ``torch.compile``, a device optimizer (``torch.optim.AdamW(fused=True)`` or
    ``memtrain.optim.build_optimizer``'s lean variants), the ``GradientAccumulator``.

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
        ConfigError: the model does not match the plan (other blocks), or the plan needs torch.distributed
            initialised with ``plan.world_size`` ranks.
    """
    s = plan.settings if isinstance(plan, Plan) else plan
    names = _check_blocks(model, s, plan.block_names if isinstance(plan, Plan) else None)
    acc = accelerator(torch.device(device) if device is not None else next(model.parameters()).device)
    device = acc.device
    precision = MixedPrecision(s.precision, device.type)  # type: ignore[arg-type]
    wrapped = configure_model(model, s)
    if s.pure_bf16:  # no fp32 master anywhere: the weights themselves become bf16 (buffers keep their dtype)
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)  # before the placement: the device never holds them in fp32
    train_model: nn.Module = model
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if (s.distribution == "none") != (world == 1):
        raise ConfigError(f"apply_plan: the plan's distribution is {s.distribution!r}, and this process group has "
                          f"{world} rank(s). To resolve this error, plan with world_size equal to torchrun's "
                          "--nproc_per_node.")
    hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    # An offloaded optimizer before DDP (which buckets the weights as they are): it may cast them to bf16. A device
    # optimizer after FSDP2, whose sharded parameters it must hold.
    optimizer = _planned_optimizer(model, s, precision, world, hyper, device) if s.optimizer != "device" else None
    # Placed after the offloaded optimizer took its masters from the host weights (and cast the device ones), before
    # DDP (which broadcasts the device weights); FSDP2 places each block as it shards it.
    streamed = streamed_params(model, names) if s.offload_weights else []
    if s.distribution != "fsdp2":
        place_model(model, acc, leave=streamed)
    weights = stream_weights(model, names, optimizer, device) if s.offload_weights else None
    if s.distribution == "fsdp2":
        # Imported here: only an FSDP2 run needs torch.distributed's FSDP (not every torch build has it).
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16-mixed: blocks gathered (and computed) in bf16, gradients reduce-scattered in fp32 into the fp32
        # shards the optimizer steps; autocast still runs the fp32 ops (norms, softmax, the loss) in fp32.
        gathered = fsdp2_param_dtype(s.precision)
        policy = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32 if gathered else None)
        modules = dict(model.named_modules())
        for name in names:
            fully_shard(modules[name], mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif s.distribution == "ddp":
        ids = [device.index] if acc.kind not in ("cpu", "simulated") else None
        # Each p.grad is a view into DDP's all-reduce bucket: one copy of the gradients, not two.
        train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    if s.compile:
        # Per block where blocks offload their activations (saved-tensor hooks cannot be traced), else whole.
        train_model = compile_model(train_model)
    if optimizer is None:
        optimizer = _planned_optimizer(model, s, precision, world, hyper, device)
    accumulator = GradientAccumulator(train_model, optimizer, steps=s.accumulation, scaler=precision.scaler,
                                      scheduler=scheduler(optimizer) if scheduler is not None else None,
                                      max_grad_norm=max_grad_norm)
    return AppliedPlan(settings=s, model=model, train_model=train_model, optimizer=optimizer, accumulator=accumulator,
                      precision=precision, blocks=wrapped, weights=weights)


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
        raise ConfigError("apply_plan: offload_weights=True needs the offloaded optimizer, whose host master the "
                          "blocks' weights stream from. To resolve this error, plan with optimizer 'offload'.")
    modules = dict(model.named_modules())
    params = [p for name in blocks for p in modules[name].parameters() if p.requires_grad]
    streamer = WeightStreamer(model, blocks=blocks, device=device, host_weights=optimizer.stream_weights(params))
    optimizer.wait_for_fills(streamer.fills_done)
    return streamer


def configure_model(model: nn.Module, settings: PlanSettings) -> list[str]:
    """The model's part of ``apply_plan``, in place: checkpointing per block (recompute / offload, the
    flavor), the chunked loss, no KV cache. Undoes what an earlier plan set, so a re-plan calls it again.
    Returns the wrapped blocks' names.

    Raises:
        ConfigError: the model's blocks are not the plan's.
    """
    names = _check_blocks(model, settings, None)
    wrapped: list[str] = []
    if settings.blocks:  # no blocks detected: checkpointing the user applied by hand stays
        remove_checkpointing(model)
    if "recompute" in settings.blocks or "offload" in settings.blocks:
        wrapped = apply_checkpointing(
            model, policies=settings.policies(names),
            selective=("matmul", "attention") if settings.flavor == "selective" else None,
            offload=settings.flavor == "offload-inputs")
    remove_chunked_loss(model)
    if settings.chunked_loss:
        apply_chunked_loss(model)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # a KV cache only holds memory in training (the plan's estimate has none)
    return wrapped


def _check_blocks(model: nn.Module, s: PlanSettings, planned: tuple[str, ...] | None) -> list[str]:
    names = find_blocks(model)
    if len(names) != len(s.blocks) or (planned is not None and tuple(names) != planned):
        raise ConfigError(f"apply_plan: the model's {len(names)} blocks {names[:3]}... are not the plan's "
                          f"{len(s.blocks)} (made for another model). To resolve this error, plan this model.")
    return names


def _planned_optimizer(model: nn.Module, s: PlanSettings, precision: Any, world: int,
                       hyper: dict[str, Any], device: torch.device) -> torch.optim.Optimizer:
    """The optimizer as the plan places it (AdamW, or the run's named class), over the parameters that require grad
    (a LoRA model's adapters)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    named = s.optimizer_class
    if s.optimizer == "device" and s.state_precision == "fp32" and not (s.step_in_backward or s.offload_fraction
                                                                         or s.pure_bf16):
        if not named.is_adamw:  # the run's own class, as it comes
            cls = named.resolve()
            return cls([p for _, p in trainable], **named.hyperparameters(**hyper))
        # fused: one kernel per step (CUDA and CPU), and the same kernel CPUOffloadOptimizer runs on the host.
        return torch.optim.AdamW([p for _, p in trainable], fused=True, **hyper)
    if s.optimizer == "device":
        return build_optimizer(trainable, state_precision=s.state_precision, offload_fraction=s.offload_fraction,
                               step_in_backward=s.step_in_backward, grad_scaler=precision.scaler,
                               world_size=world, pure_bf16=s.pure_bf16, optimizer_class=named, **hyper)

    # NOTE: under DDP, gradients stay on the device until the step: DDP averages them after the hooks that would
    # have copied them to the host. In one process they stream to the host during backward.
    # offload-bf16-weights: the fp32 master takes the weights' full digits, then the device copy becomes bf16.
    bf16 = torch.bfloat16 if s.optimizer == "offload-bf16-weights" else None
    # NOTE: frozen weights (a LoRA model's base) have no master to keep: bf16 on the device too, as the plan
    # estimated every weight on the device (estimate(weights_dtype="bf16")).
    for p in model.parameters() if bf16 is not None else ():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(bf16)
    if not named.is_adamw:  # the run's own class on the host: the run's hyper-parameters it takes, its kwargs
        named.state_sizes((1,), torch.float32)  # a class that cannot step on the host: one clear error, now
        hyper = {"optimizer_class": named.resolve(),
                 **named.hyperparameters(**hyper)}
    return CPUOffloadOptimizer(trainable, offload_gradients=world == 1, grad_scaler=precision.scaler,
                               device_dtype=bf16, state_precision=s.state_precision, pure_bf16=s.pure_bf16,
                               device=device, **hyper)
