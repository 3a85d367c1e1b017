"""``estimate``'s arguments, checked: the choices it knows, the bounds that keep a trace short, and every problem
reported at once, naming the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import torch
from torch import nn

from memtrain.checkpointing import Checkpointing, apply_checkpointing
from memtrain.choices import Choices
from memtrain.errors import ConfigError
from memtrain.estimate.fake import batch_spec, max_positions, meta_model
from memtrain.estimate.optimizer_state import as_optimizer
from memtrain.estimate.tracker import numel
from memtrain.loss import chunk_tokens_of, supports_chunked_loss
from memtrain.message import arg, marked
from memtrain.techniques import REGISTRY, SetUp
from memtrain.techniques import problems as rule_problems
from memtrain.techniques.optimizer import STATE_PRECISIONS, NamedOptimizer
from memtrain.tiled_mlp import supports_tiled_mlp

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]
# memtrain's AdamW on the device or offloaded, estimate's names for torch's optimizers (as_optimizer), or any other
# optimizer by short name, dotted path or class (memtrain.techniques.optimizer).
OptimizerKind = Literal["adamw", "sgd", "sgd-momentum", "adafactor", "adamw-offload"] | str | type

AUTOCAST_DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}

WEIGHT_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Work that keeps estimate bounded: a real model has at most a few hundred blocks, and a step whose loss needs
# more chunks than this holds far more tokens than any device (it is refused before anything is traced).
MAX_LAYERS = 10_000
MAX_LOSS_CHUNKS = 65_536
COMPILE_NOTE = ("setup.compile=True: this is the eager step's peak; torch.compile fuses kernels and may save fewer or "
                "other tensors, so measure the compiled step (memtrain.measure, or memtrain train's first steps) to "
                "know its own")


# -- arguments ----------------------------------------------------------------------------------------------
def _checkpointing_kwargs(checkpointing: Any, problems: list[str]) -> Checkpointing | dict[str, Any] | None:
    """A ``Checkpointing`` for every spelling it parses, or a mapping of ``apply_checkpointing`` arguments as
    given; None (with the problem noted) for anything else."""
    if isinstance(checkpointing, Mapping):
        allowed = [n for n in inspect.signature(apply_checkpointing).parameters if n != "model"]
        unknown = [k for k in checkpointing if k not in allowed]
        if unknown:
            problems.append(f"checkpointing: unknown apply_checkpointing arguments {unknown}. To resolve this "
                            f"error, use only {allowed}.")
            return None
        return dict(checkpointing)
    try:
        return Checkpointing.parse(checkpointing)
    except ConfigError as e:
        problems.append(f"{marked(e)} (or a dict of apply_checkpointing arguments such as {{'every': 2}})")
        return None


def setup_options(setup: Any, *, checkpointing: Any, optimizer: Any,
                  precision: Any) -> tuple[dict[str, Any], list[str]]:
    """``estimate``'s one set-up as ``trace``'s keyword arguments (a None in ``setup`` means off, fp32, no offload),
    with every contradiction between ``setup`` and the ``checkpointing=`` / ``optimizer=`` / ``precision=``
    arguments, in words naming the fix: each technique's part is its own (``Technique.trace_options``). Where there
    is a problem the option keeps its default, so the other arguments are still checked."""
    problems: list[str] = []
    if setup is None:
        setup = Choices()
    if not isinstance(setup, Choices):
        problems.append(f"setup={setup!r} is not a memtrain.choices.Choices. To resolve this error, pass e.g. "
                        "setup=Choices(offload_activations=True), or Choices.from_dict(...) of a mapping.")
        setup = Choices()
    problems += setup.precision_problems(precision, auto=False)  # the rule a run applies: one answer everywhere
    options: dict[str, Any] = {}
    for technique in REGISTRY:
        own, own_problems = technique.trace_options(setup, checkpointing=checkpointing, optimizer=optimizer)
        assert not own.keys() & options.keys(), f"{technique} gives {sorted(own.keys() & options.keys())} again"
        options.update(own)
        problems += own_problems
    return options, problems


def _check_choice(name: str, value: Any, allowed: tuple[str, ...], problems: list[str]) -> None:
    if value not in allowed:
        problems.append(f"{arg(name, value)} is not known. To resolve this error, pass one of {list(allowed)}.")


def _check_layers(model: Any, problems: list[str]) -> None:
    """Refuses a model too deep to trace in bounded time, before building it."""
    config = getattr(model, "config", model)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        layers = getattr(config, attr, None)
        if isinstance(layers, int) and layers > MAX_LAYERS:
            problems.append(f"{attr}={layers:,}: more layers than estimate traces in bounded time ({MAX_LAYERS:,}; "
                            "the deepest published models have a few hundred). To resolve this error, fix the "
                            "config's layer count.")
            return


def check_arguments(
    model: Any,
    batch: Any,
    *,
    device: str,
    precision: Precision,
    checkpointing: Any,
    offload_activations: bool,
    optimizer: OptimizerKind,
    state_precision: str,
    offload_fraction: float,
    step_in_backward: bool,
    chunked_loss: bool,
    micro_batch_size: int | None,
    seq_len: int | None,
    accumulation: int,
    weights_dtype: str | None,
    pure_bf16: bool = False,
    tiled_mlp: bool = False,
) -> tuple[str, bool, Checkpointing | dict[str, Any] | None, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """``trace``'s arguments checked before anything is built: (device type, whether AdamW is memtrain.optim's
    lean one, the checkpointing asked for, the batch's named shapes).

    Raises:
        ConfigError: every problem at once.
    """
    problems: list[str] = []
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError):
        device_type = str(device)
    _check_choice("device", device_type, ("cuda", "cpu"), problems)
    if not isinstance(offload_activations, bool):
        problems.append(f"{arg('offload_activations', offload_activations)} must be True or False. To resolve "
                        f"this error, pass {arg('offload_activations', True)} or False.")
    if not isinstance(chunked_loss, bool):
        problems.append(f"{arg('chunked_loss', chunked_loss)} must be True or False. To resolve this error, pass "
                        f"{arg('chunked_loss', True)} or False.")
    if not isinstance(tiled_mlp, bool):
        problems.append(f"{arg('tiled_mlp', tiled_mlp)} must be True or False. To resolve this error, pass "
                        f"{arg('tiled_mlp', True)} or False.")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        problems.append(f"accumulation={accumulation!r} must be an integer >= 1 (micro-batches per step). To "
                        "resolve this error, pass e.g. accumulation=1.")
    if weights_dtype not in WEIGHT_DTYPES:
        problems.append(f"weights_dtype={weights_dtype!r} is not known. To resolve this error, pass one of "
                        f"{[k for k in WEIGHT_DTYPES if k]} or None (the model's own).")
    _check_choice("precision", precision, get_args(Precision), problems)
    try:
        named = as_optimizer(optimizer)
    except ConfigError as e:
        named = "adamw"
        problems += [p if p.startswith("optimizer=") else f"optimizer={optimizer!r}: {marked(p)}" for p in e.problems]
    _check_choice("state_precision", state_precision, STATE_PRECISIONS, problems)
    if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)) or not (
            0.0 <= offload_fraction <= 1.0):
        problems.append(f"{arg('offload_fraction', offload_fraction)} must be a number in [0, 1]. To resolve this "
                        f"error, pass e.g. {arg('offload_fraction', 1.0)} (every parameter's state on the host) or 0.")
    if not isinstance(step_in_backward, bool):
        problems.append(f"{arg('step_in_backward', step_in_backward)} must be True or False. To resolve this "
                        f"error, pass {arg('step_in_backward', True)} or False.")
    lean = state_precision != "fp32" or bool(offload_fraction) or step_in_backward is True or pure_bf16 is True
    if isinstance(named, NamedOptimizer):  # the wrappers take any class; lean moments and pure bf16 are AdamW's
        problems += rule_problems(SetUp(optimizer=named, state_precision=state_precision, pure_bf16=pure_bf16))
        lean = False
    ckpt = _checkpointing_kwargs(checkpointing, problems)
    spec = batch_spec(batch, micro_batch_size, seq_len, problems)
    _check_layers(model, problems)
    ConfigError.raise_if(problems)
    assert spec is not None
    return device_type, lean, ckpt, spec


def problems_before_tracing(model: Any, batch: Any, known: list[str], **arguments: Any) -> list[str]:
    """``known`` (e.g. the set-up's problems) with every other problem found before tracing: ``check_arguments``'
    (``arguments``: its keywords), and, where there is any problem, the batch's against the model built on the meta
    device (``check_against_model``: without one, ``trace`` checks that itself, so a good call builds it once).
    """
    problems = list(known)
    try:
        check_arguments(model, batch, **arguments)
    except ConfigError as e:
        problems += e.problems
    if problems:
        problems += _model_problems(model, batch, arguments)
    return problems


def _model_problems(model: Any, batch: Any, arguments: Mapping[str, Any]) -> list[str]:
    """The batch's problems against the model (``check_against_model``), where the batch and the model's depth are
    good enough to build it; a model that cannot be built is named here only where that is a ConfigError."""
    scratch: list[str] = []
    spec = batch_spec(batch, arguments.get("micro_batch_size"), arguments.get("seq_len"), scratch)
    _check_layers(model, scratch)
    if spec is None or scratch:
        return []  # check_arguments named what is wrong with them
    try:
        check_against_model(meta_model(model), spec, arguments.get("chunked_loss") is True,
                            tiled_mlp=arguments.get("tiled_mlp") is True)
    except ConfigError as e:
        return list(e.problems)
    except Exception:  # noqa: BLE001 - the trace names a model that fails to build, once the rest is fixed
        return []
    return []


def kept_labels(batch: Any) -> int | None:
    """The positions of a dict batch whose label counts (not -100, after the shift by one a causal LM's loss makes),
    where its ``labels`` are a tensor with values: what memtrain's loop counts on the host and passes the chunked
    loss (``memtrain.loss.kept_positions``), so that a prompt or padding costs no matmul of the head. None: every
    position counts (no labels given, or given as a shape)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.device.type == "meta" or labels.dim() < 1:
        return None
    return int((labels[..., 1:] != -100).sum())


def batch_values(batch: Any) -> tuple[bool, bool]:
    """What the values of a dict batch say that its shapes do not, as (packed, padded).

    A dict batch passes its entries to the model by name (labels: the input ids unless it has ``labels``), e.g.
    memtrain's loop on packed rows: ``{"input_ids", "labels", "position_ids"}``. Two things in it change the step:
    ``position_ids`` that restart inside a row (several documents a row, as ``memtrain.data.PackedRows`` gives:
    Hugging Face models then build a block-diagonal attention mask), and an ``attention_mask`` with zeros (padding:
    kept as a mask; an all-ones one is left out). A tensor's values decide; one given as a shape (or on the meta
    device) is taken to restart, or to pad."""
    if not isinstance(batch, Mapping):
        return False, False
    positions, mask = batch.get("position_ids"), batch.get("attention_mask")
    return (positions is not None and _unknown_or(positions, lambda t: (torch.diff(t, dim=-1) != 1).any()),
            mask is not None and _unknown_or(mask, lambda t: (t == 0).any()))


def _unknown_or(value: Any, test: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.dim() != 2:
        return True
    return bool(test(value))


def check_against_model(meta: nn.Module, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                        chunked_loss: bool, *, tiled_mlp: bool = False) -> int:
    """The batch checked against the model built from the config: positions, and a chunked loss it supports in
    bounded time. Returns the loss's chunk size in tokens (the model's own when its loss is chunked already).

    Raises:
        ConfigError: every problem at once.
    """
    problems: list[str] = []
    max_pos = max_positions(meta)
    tokens = 0
    if "input_ids" in spec and len(spec["input_ids"][0]) >= 2:
        shape = spec["input_ids"][0]
        tokens = numel(shape)
        if max_pos is not None and shape[1] > max_pos:
            problems.append(f"batch: sequences of {shape[1]} tokens are longer than the model's {max_pos} positions. "
                            f"To resolve this error, pass {arg('seq_len')} <= {max_pos} or a config with more "
                            "positions.")
    problems += rule_problems(SetUp(chunked_loss=chunked_loss, chunkable=supports_chunked_loss(meta),
                                    tiled_mlp=tiled_mlp, tileable=supports_tiled_mlp(meta) if tiled_mlp else None))
    chunk_tokens = chunk_tokens_of(meta) or 1024  # the model's own chunk size when its loss is chunked already
    if chunked_loss and tokens > MAX_LOSS_CHUNKS * chunk_tokens:
        problems.append(f"batch: {tokens:,} tokens per micro-batch make {tokens // chunk_tokens:,} loss chunks of "
                        f"{chunk_tokens}, more than estimate traces in bounded time ({MAX_LOSS_CHUNKS:,}); no device "
                        "holds such a micro-batch. To resolve this error, pass a smaller micro-batch or sequence "
                        "length (accumulate micro-batches to reach the batch you want).")
    ConfigError.raise_if(problems)
    return chunk_tokens
