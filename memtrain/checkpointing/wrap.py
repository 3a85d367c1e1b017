"""Wrapping blocks in place: ``apply_checkpointing``, ``remove_checkpointing`` and ``checkpoint_sequential``."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import get_args

import torch
from torch import nn

from memtrain.checkpointing.blocks import BlockPolicy, BlockSelector, has_parameters, select_blocks
from memtrain.checkpointing.compile import COMPILE_ATTR, compile_blocks
from memtrain.checkpointing.forward import (
    CheckpointedForward,
    CheckpointSpec,
    checkpointed_call,
    let_compiled_checkpoints_run_side_effects_once,
    running_stat_modules,
)
from memtrain.checkpointing.selective import OpKind, SelectivePolicy, resolve_selective
from memtrain.errors import ConfigError
from memtrain.offload import ActivationOffloader, offload_activations

_USE_CACHE_ATTR = "_memtrain_use_cache"


def _check_model(model: nn.Module, problems: list[str]) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"apply_checkpointing needs an nn.Module, got {type(model).__name__}. To resolve this "
                          "error, pass the model (an nn.Module) whose blocks to checkpoint.")
    if not has_parameters(model):
        problems.append(
            f"{type(model).__name__} has no parameters, so there is no gradient to checkpoint for. "
            "To resolve this error, pass the model being trained."
        )
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except ImportError:  # torch built without distributed
        ActivationWrapper = ()  # noqa: N806
    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, ActivationWrapper)]
    if wrapped:
        problems.append(
            f"modules {wrapped[:3]} are already wrapped by torch's checkpoint_wrapper; wrapping again would "
            "recompute them twice. To resolve this error, build the model without checkpoint_wrapper and let "
            "apply_checkpointing choose the blocks."
        )
    hf_flag = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5; older: is_gradient_checkpointing
    if hf_flag is None:
        hf_flag = getattr(model, "is_gradient_checkpointing", False)
    if hf_flag:
        problems.append(
            f"{type(model).__name__} has Hugging Face gradient checkpointing enabled; both together would "
            "recompute every block twice. To resolve this error, call model.gradient_checkpointing_disable() "
            "before apply_checkpointing (or use one of the two)."
        )


def apply_checkpointing(
    model: nn.Module,
    *,
    blocks: BlockSelector = None,
    every: int = 1,
    selective: SelectivePolicy | Sequence[OpKind] | None = None,
    offload: bool = False,
    policies: Mapping[str, BlockPolicy] | None = None,
    offloader: ActivationOffloader | None = None,
) -> list[str]:
    """Checkpoints the repeated blocks of ``model`` in place: one extra forward of time for their activations.

    On an 8-block GPT full checkpointing keeps only each block's input and the loss (at least 10x fewer saved
    bytes: ``pytest tests/test_checkpointing_wrap.py -k 10x``); ``every=2`` about halves the saved bytes; ``selective`` keeps matmul and
    attention outputs, saving less memory than full checkpointing but recomputing only cheap ops.

    Under torch.compile, a checkpointed block's Python side effects run once, in forward (as its BatchNorm
    statistics do): this sets dynamo's process-wide ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (torch >=
    2.9, ``let_compiled_checkpoints_run_side_effects_once``), without which transformers >= 5.25's attention
    layers break the graph and the model runs eagerly.

    Args:
        model: any ``nn.Module``, Hugging Face ``PreTrainedModel`` included (its ``use_cache`` is switched off;
            ``remove_checkpointing`` switches it back).
        blocks: which modules to wrap. ``None`` auto-detects the repeated blocks (Hugging Face
            ``_no_split_modules``, else the children of an ``nn.ModuleList``/``nn.Sequential`` that are alike:
            one class, or structurally identical ``nn.Sequential`` blocks); or a module class (or tuple), a
            predicate ``(name, module) -> bool``, or a list of qualified names.
        every: checkpoint one block in ``every`` (blocks 0, k, 2k, ...); 1 checkpoints all of them.
        selective: op kinds whose outputs are kept instead of recomputed, e.g. ``("matmul", "attention")``, or a
            ``SelectivePolicy``. ``None`` recomputes the whole block.
        offload: keep the recomputed blocks' saved inputs in pinned host memory, copied on a side stream and
            prefetched before backward needs them (a no-op, said once, without CUDA).
        policies: a per-block choice overriding ``every``: ``{name: "keep" | "recompute" | "offload"}`` for
            blocks among those selected; "offload" keeps every activation of the block in host memory and
            recomputes nothing (PCIe traffic instead of compute).
        offloader: the ``ActivationOffloader`` the offloaded blocks share (default:
            ``offload_activations(device=<the model's device>)``, built when ``offload`` or a policy needs it).

    Returns:
        The qualified names of the modules wrapped. Calling again replaces the previous wrapping with the new
        settings: a block is never wrapped twice.

    Raises:
        ConfigError: blocks that match nothing, ``every < 1``, an unknown policy, a model without parameters, or
            a model already checkpointed by torch's ``checkpoint_wrapper`` or Hugging Face; every problem at once.

    Example:
        >>> from memtrain.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, seq_len=16))
        >>> apply_checkpointing(model)
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
        >>> apply_checkpointing(model, every=2)
        ['blocks.0', 'blocks.2']
    """
    problems: list[str] = []
    _check_model(model, problems)
    every = _checked_every(every, problems)
    policy = resolve_selective(selective, problems)
    names = select_blocks(model, blocks, problems) if has_parameters(model) else []
    choices = _block_choices(names, every, policies or {}, problems)
    if offloader is not None and not isinstance(offloader, ActivationOffloader):
        problems.append(f"offloader={type(offloader).__name__}: it must be an ActivationOffloader. To resolve "
                        "this error, pass offload_activations(...) or leave it None.")
    ConfigError.raise_if(problems)
    offloader = _shared_offloader(model, offloader, offload or "offload" in choices.values())

    # Re-wrapping with new settings starts from a clean model, so "every" means the same on every call.
    remove_checkpointing(model)
    recompute = CheckpointSpec(selective=policy, offloader=offloader if offload else None)
    offloaded = CheckpointSpec(policy="offload", offloader=offloader)
    chosen = _wrap_blocks(model, choices, recompute=recompute, offloaded=offloaded)
    _switch_off_kv_cache(model)
    compiled = getattr(model, COMPILE_ATTR, None)
    if compiled is not None:
        compile_blocks(model, compiled)  # compile_model compiled the earlier wrapping per block: so this one
    return chosen


def _checked_every(every: int, problems: list[str]) -> int:
    """``every`` if it is an integer >= 1; else 1, with the problem."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        problems.append(f"every={every!r}: it must be an integer >= 1. To resolve this error, pass every=1 "
                        "(every block) or every=2 (one block in two).")
        return 1
    return every


def _block_choices(names: list[str], every: int, policies: Mapping[str, BlockPolicy],
                   problems: list[str]) -> dict[str, BlockPolicy]:
    """Each selected block's policy, in the blocks' order: one in ``every`` recomputed, the rest kept, then
    ``policies`` over them (an unknown policy or block is a problem)."""
    choices: dict[str, BlockPolicy] = {name: ("recompute" if i % every == 0 else "keep")
                                       for i, name in enumerate(names)}
    for name, choice in policies.items():
        if choice not in get_args(BlockPolicy):
            problems.append(f"policies[{name!r}]={choice!r}: unknown policy. To resolve this error, use one of "
                            f"{list(get_args(BlockPolicy))}.")
        elif name not in choices:
            problems.append(f"policies names {name!r}, which is not one of the selected blocks ({names[:3]}...). "
                            "To resolve this error, use the names apply_checkpointing(model) returns.")
        else:
            choices[name] = choice
    return choices


def _shared_offloader(model: nn.Module, offloader: ActivationOffloader | None,
                      needed: bool) -> ActivationOffloader | None:
    """The offloader every offloading block shares (``offloader``, or one built when ``needed``), told the model's
    weights."""
    if offloader is None and needed:
        # One offloader for the whole model: one pinned pool, one recorded backward order.
        offloader = offload_activations(device=next(model.parameters()).device)
    if offloader is not None:
        # Entered per block, it is not given the model: it must still know the weights (frozen ones and their
        # autocast copies too), which stay on the device.
        offloader.track_state(model)
    return offloader


def _wrap_blocks(model: nn.Module, choices: Mapping[str, BlockPolicy], *, recompute: CheckpointSpec,
                 offloaded: CheckpointSpec) -> list[str]:
    """Wraps each block whose policy is not "keep" (an "offload" one with ``offloaded``, the others with
    ``recompute``); returns their names."""
    modules = dict(model.named_modules())
    chosen = [name for name, choice in choices.items() if choice != "keep"]
    for name in chosen:
        _wrap(modules[name], offloaded if choices[name] == "offload" else recompute)
    if chosen:
        let_compiled_checkpoints_run_side_effects_once()
    return chosen


def _switch_off_kv_cache(model: nn.Module) -> None:
    """A KV cache would be appended to twice (forward and recompute); it is useless in training anyway.
    ``remove_checkpointing`` switches it back on."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None):
        setattr(model, _USE_CACHE_ATTR, True)
        config.use_cache = False


def _wrap(module: nn.Module, spec: CheckpointSpec) -> None:
    had_instance_forward = "forward" in module.__dict__
    module.forward = CheckpointedForward(module, module.forward, had_instance_forward, spec)  # type: ignore[method-assign]


def checkpoint_spec(module: nn.Module) -> CheckpointSpec | None:
    """How ``apply_checkpointing`` wrapped ``module`` (its policy, its offloader), or None for a module it did not
    wrap: what the loop and the estimator ask of a block."""
    forward = module.__dict__.get("forward")
    return forward.spec if isinstance(forward, CheckpointedForward) else None


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undoes ``apply_checkpointing``: restores each block's forward and the model's ``use_cache``.

    Returns:
        The qualified names of the modules unwrapped.
    """
    removed = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, CheckpointedForward):
            if forward.had_instance_forward:
                module.forward = forward.original  # type: ignore[method-assign]
            else:
                del module.forward
            removed.append(name)
    if getattr(model, _USE_CACHE_ATTR, False):
        model.config.use_cache = True
        delattr(model, _USE_CACHE_ATTR)
    return removed


def checkpoint_sequential(
    functions: nn.Sequential | Sequence[nn.Module],
    segments: int,
    input: torch.Tensor,
    *,
    selective: SelectivePolicy | Sequence[OpKind] | None = None,
) -> torch.Tensor:
    """Runs ``functions`` in ``segments`` chunks, checkpointing every chunk but the last.

    The last chunk is not checkpointed: backward needs its activations at once, so recomputing them would cost
    time and save nothing. Non-reentrant, RNG-exact and BatchNorm-safe, like ``apply_checkpointing``.

    Args:
        functions: an ``nn.Sequential`` or a list of modules applied in order.
        segments: number of chunks, 1 to ``len(functions)``.
        input: the input of the first module.
        selective: as in ``apply_checkpointing``.

    Example:
        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> checkpoint_sequential(layers, 2, torch.randn(3, 8)).shape
        torch.Size([3, 8])
    """
    modules = list(functions)
    problems: list[str] = []
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= max(len(modules), 1):
        problems.append(f"segments={segments!r}: it must be an integer from 1 to {len(modules)} (the number of "
                        "modules). To resolve this error, pass e.g. segments=2.")
    if not modules:
        problems.append("checkpoint_sequential got no modules. To resolve this error, pass a non-empty nn.Sequential.")
    policy = resolve_selective(selective, problems)
    ConfigError.raise_if(problems)
    spec = CheckpointSpec(selective=policy)
    checkpoint_kwargs = spec.checkpoint_kwargs
    let_compiled_checkpoints_run_side_effects_once()
    bounds = [round(i * len(modules) / segments) for i in range(segments + 1)]
    x = input
    for i, (start, stop) in enumerate(zip(bounds, bounds[1:], strict=False)):
        chunk = modules[start:stop]
        run = functools.partial(_run_chunk, chunk)
        if i == segments - 1:
            x = run(x)
        else:
            norms = [n for m in chunk for n in running_stat_modules(m)]
            x = checkpointed_call(run, spec, checkpoint_kwargs, norms, x)
    return x


def _run_chunk(chunk: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for module in chunk:
        x = module(x)
    return x
