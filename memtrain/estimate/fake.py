"""The step's inputs without data: the model as meta or fake tensors (from a module or a Hugging Face config), the
batch as named shapes, and how to call the model with them (Hugging Face, memtrain's GPT, or ``model(x)``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrain.errors import ConfigError, describe_exception
from memtrain.loss import KEPT_ARGUMENT, chunk_tokens_of
from memtrain.message import arg
from memtrain.quantize import is_quant_state, meta_stand_ins, quant_state_memo
from memtrain.unwrap import unwrap_model


# -- a Hugging Face config file -----------------------------------------------------------------------------
def hf_config_from_file(path: str | os.PathLike[str]) -> Any:
    """Reads a Hugging Face ``config.json`` (plain JSON, nothing executed) into its ``PretrainedConfig``.

    Raises:
        ConfigError: the file is missing, is not JSON, has no ``model_type``, or names a type transformers lacks.
    """
    try:  # lazily: transformers is an optional extra
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("reading a Hugging Face config needs transformers. To resolve this error, "
                          "pip install 'memtrain[hf]'.") from None
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"could not read the Hugging Face config {str(path)!r}: {e}. To resolve this error, pass "
                          "the path of a config.json file.") from None
    model_type = fields.pop("model_type", None) if isinstance(fields, dict) else None
    if not model_type:
        raise ConfigError(f"{str(path)!r} has no \"model_type\" field, so its model class is unknown. To resolve "
                          "this error, add e.g. \"model_type\": \"llama\" to the file.")
    try:
        from transformers import CONFIG_MAPPING

        known = model_type in CONFIG_MAPPING
    except ImportError:
        known = True
    if not known:
        raise ConfigError(f"{str(path)!r}: transformers does not know model_type={model_type!r}. To resolve this "
                          "error, upgrade transformers or fix the model_type.")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 - transformers validates fields with exceptions of many types
        raise ConfigError(f"{str(path)!r}: a field of this {model_type} config is invalid "
                          f"({describe_exception(e)}). To resolve "
                          "this error, fix that field in the file.") from None


# -- the model, as fake tensors -----------------------------------------------------------------------------
def meta_model(model: Any, leave_out: Iterable[nn.Module] = ()) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (no data copied); the submodules in
    ``leave_out`` are not copied (None in their place: the caller drops them, e.g. a deep model's interior blocks)."""
    try:
        from transformers import PretrainedConfig
    except ImportError:  # transformers is optional
        PretrainedConfig = ()  # noqa: N806
    if PretrainedConfig and isinstance(model, PretrainedConfig):
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                # fp32 weights whatever the config's torch_dtype says (a hub config often says bfloat16): the
                # run trains fp32 weights under mixed precision; bf16 weights are --pure-bf16, an explicit choice.
                return AutoModelForCausalLM.from_config(copy.deepcopy(model)).float()
        except Exception as e:  # noqa: BLE001 - re-raised with the fix
            raise ConfigError(
                f"estimate: could not build a causal LM from {type(model).__name__} ({type(e).__name__}: {e}). "
                "To resolve this error, pass a config AutoModelForCausalLM knows, or build the model yourself under "
                "`with torch.device('meta'):` and pass the module."
            ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"estimate: model is a {type(model).__name__}, not an nn.Module or a Hugging Face config. "
            "To resolve this error, pass the module (any device, meta included) or its PretrainedConfig."
        )
    # The memo makes deepcopy reuse meta stand-ins for parameters and buffers: no data is copied, ties survive.
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    memo.update(quant_state_memo(model))  # 4-bit weights' scales are not copied: stand-ins replace those layers
    memo.update({id(m): None for m in leave_out})
    return meta_stand_ins(copy.deepcopy(model, memo))


def to_fake(model: nn.Module, fake_mode: FakeTensorMode) -> None:
    """Replaces every parameter and buffer by a fake CPU tensor of the same shape, in place (ties kept)."""
    done: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            with fake_mode:
                data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            done[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        return done[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b)


# -- the batch ----------------------------------------------------------------------------------------------
def _shape_of(x: Any) -> tuple[tuple[Any, ...], torch.dtype] | None:
    """(shape, dtype) of a tensor or of a shape given as numbers (checked by ``_bad_dimensions``), else None."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, torch.Size) or (isinstance(x, (tuple, list)) and x and all(isinstance(d, numbers.Number)
                                                                                 for d in x)):
        return tuple(x), torch.long
    return None


def _is_count(value: Any) -> bool:
    """An integer >= 1 (not a bool, not a float that happens to be whole)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _bad_dimensions(where: str, shape: tuple[Any, ...], problems: list[str]) -> None:
    """One problem naming each dimension of ``shape`` that is not an integer >= 1 (a traced batch needs sizes)."""
    bad = [f"dimension {i} is {d!r}" for i, d in enumerate(shape) if not _is_count(d)]
    if bad:
        problems.append(f"{where} of shape {tuple(shape)}: {', '.join(bad)}; every dimension of a batch must be an integer "
                        ">= 1. To resolve this error, pass sizes such as batch=(4, 2048) (micro-batch, tokens).")


def batch_spec(batch: Any, micro_batch_size: int | None, seq_len: int | None,
                problems: list[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
    """Named input shapes: ``{"input_ids": ((B, T), long)}`` for tokens, or a dict's entries."""
    bad = [arg(name, value) for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len))
           if value is not None and not _is_count(value)]
    if bad:
        problems.append(f"{' and '.join(bad)}: each must be an integer >= 1. To resolve this error, pass e.g. "
                        f"{arg('micro_batch_size', 4)}, {arg('seq_len', 2048)}.")
        return None
    if batch is None:
        if micro_batch_size is None or seq_len is None:
            problems.append(f"estimate needs a batch: none was given, and {arg('micro_batch_size')} and "
                            f"{arg('seq_len')} are not both set. To resolve this error, pass batch=(B, T), a token "
                            "tensor, or both of them.")
            return None
        spec = {"input_ids": ((micro_batch_size, seq_len), torch.long)}
    elif isinstance(batch, Mapping):
        spec = {}
        for key, value in batch.items():
            shape = _shape_of(value)
            if shape is None:
                problems.append(f"batch[{key!r}] is a {type(value).__name__}, not a tensor or a shape. To resolve "
                                "this error, pass tensors (any device, meta included) or shapes as tuples.")
                return None
            spec[key] = shape
    else:
        shape = _shape_of(batch)
        if shape is None:
            problems.append(f"batch is a {type(batch).__name__}, not a tensor, a shape or a dict of them. To resolve "
                            "this error, pass e.g. batch=(4, 2048) or the input tensor.")
            return None
        spec = {"input_ids": shape}
    resized = {}
    for key, (shape, dtype) in spec.items():
        dims = list(shape)
        if micro_batch_size is not None and dims:
            dims[0] = micro_batch_size
        if seq_len is not None and len(dims) >= 2 and not dtype.is_floating_point:
            dims[1] = seq_len
        _bad_dimensions("batch" if batch is None or not isinstance(batch, Mapping) else f"batch[{key!r}]",
                        tuple(dims), problems)
        resized[key] = (tuple(int(d) if _is_count(d) else d for d in dims), dtype)  # numpy ints as ints
    return resized


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's config allows; None when it sets no limit (XLNet's -1 among them)."""
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "seq_len"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def call_convention(model: nn.Module, spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                     explicit_dict: bool, kept: int | None = None) -> Callable[[dict[str, torch.Tensor]], Any]:
    """How to run a training forward: HF ``model(input_ids=, labels=)``, memtrain ``GPT(idx, targets)``, or
    ``model(x)``; read from the innermost model's forward (a PEFT model's, torch.compile's and DDP's take
    ``*args, **kwargs`` and pass them on: a LoRA GPT still takes its targets, and computes its loss). ``kept``: the
    positions whose label counts, which a dict batch's chunked loss is told as the loop tells it (only those reach
    the head)."""
    try:
        params = inspect.signature(unwrap_model(model, peft=True).forward).parameters
    except (TypeError, ValueError):
        params = {}
    if explicit_dict:
        add_labels = "labels" in params and "labels" not in spec and "input_ids" in spec
        counted = {KEPT_ARGUMENT: kept} if kept is not None and chunk_tokens_of(model) is not None else {}
        return lambda t: model(**t, **({"labels": t["input_ids"].clone()} if add_labels else {}), **counted)
    if "labels" in params and "input_ids" in params:
        return lambda t: model(input_ids=t["input_ids"], labels=t["input_ids"].clone())
    if "targets" in params:
        # Summed, as memtrain's loop computes it (language_model_loss): the mean's division by the token count
        # would save that count for backward (8 bytes the run does not hold) with the chunked loss.
        sum_loss = {"reduction": "sum"} if "reduction" in params else {}
        return lambda t: model(t["input_ids"], t["input_ids"].clone(), **sum_loss)
    return lambda t: model(t["input_ids"])


def convert_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's floating-point parameters in ``dtype``, in place (ties kept): e.g. bf16 device weights whose
    fp32 master lives with an offloaded optimizer."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype or is_quant_state(module, name):
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]

# -- Hugging Face on fake tensors ---------------------------------------------------------------------------
def packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor:
    """Each position's document within its row, as transformers' ``find_packed_sequence_indices`` computes it (the
    same ops, so the same tensors), without its check of the values: a packed batch is taken as packed."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def _known_padding(original: Callable[..., bool], padded: bool) -> Callable[..., bool]:
    """transformers' test of whether a padding mask can be left out, answered by ``padded`` (fake tensors have no
    values to read): a mask with padding is kept; an all-ones one is the same as none."""
    return lambda padding_mask, *args: False if padding_mask is not None and padded else original(None, *args)


@contextlib.contextmanager
def hf_sees_real_tensors(packed: bool = False, padded: bool = False) -> Iterator[None]:
    """Makes Hugging Face take the path a real training batch takes.

    It treats fake tensors as graph tracing, and would then build an explicit attention mask (and repeat grouped
    key/value heads) where the real run passes ``is_causal=True``; and it reads values that fake tensors do not
    hold, answered here: ``packed``, whether the position ids restart inside a row (several documents a row: a
    block-diagonal mask, as the real run builds; else none); ``padded``, whether an attention mask has zeros (kept
    as a mask; else left out, as for an all-ones one). Some models look for padding tokens in the batch only to log
    a warning: skipped (the values are not there; no memory).
    """
    patches = []
    try:
        from transformers import PreTrainedModel, masking_utils
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    if hasattr(PreTrainedModel, "warn_if_padding_and_no_attention_mask"):
        patches.append((PreTrainedModel, "warn_if_padding_and_no_attention_mask", lambda self, *args: None))
    if hasattr(import_utils, "is_fake_tensor"):
        patches.append((import_utils, "is_fake_tensor", lambda x: False))
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        patches.append((masking_utils, "find_packed_sequence_indices",
                        packed_sequence_indices if packed else lambda position_ids: None))
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        if hasattr(masking_utils, name):
            patches.append((masking_utils, name, _known_padding(getattr(masking_utils, name), padded)))
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in originals:
            setattr(module, name, value)


# -- kernels whose meta function differs from the real one ---------------------------------------------------
_GROUPED_MM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_grouped_mm_strides(name: str, t: torch.Tensor) -> None:
    """The real kernels' layout rule: one of the last two dimensions contiguous, the other's stride 16-byte aligned."""
    alignment = 16 // t.element_size()
    rows, columns = t.stride()[-2:]
    if columns == 1 and rows >= max(1, t.shape[-1]):
        aligned = rows % alignment == 0
    elif rows == 1 and columns >= max(1, t.shape[-2]):
        aligned = columns % alignment == 0
    else:
        aligned = False
    torch._check(aligned, lambda: f"grouped_mm: {name} of shape {tuple(t.shape)} and strides {t.stride()}: strides "
                                  "should be multiple of 16 bytes")


def grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch._grouped_mm``'s output, as the real kernels (CPU and CUDA) allocate it.

    Mixture-of-experts layers (transformers' default ``grouped_mm`` experts) run it in the weights' dtype. torch's
    meta function accepts only bf16 (the CUDA fast path) and pads the output's rows to 16 bytes only in a CUDA build,
    while the CPU kernel and CUDA's fallback also run fp32 and fp16, and every kernel pads: this is what they do.
    """
    torch._check(mat_a.dtype == mat_b.dtype and mat_a.dtype in _GROUPED_MM_DTYPES,
                 lambda: f"grouped_mm: expected both inputs in one of {_GROUPED_MM_DTYPES}, got {mat_a.dtype} and "
                         f"{mat_b.dtype}")
    _check_grouped_mm_strides("mat_a", mat_a)
    _check_grouped_mm_strides("mat_b", mat_b)
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_2d and b_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def needs_own_kernel(func: Any) -> bool:
    """Whether ``func`` is an op whose meta function differs from the real kernels (``grouped_mm_output``)."""
    return func is torch.ops.aten._grouped_mm.default
