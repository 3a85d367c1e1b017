"""Chunked cross-entropy: the head's logits recomputed chunk by chunk in backward, never held whole.

With every block checkpointed, the largest saved tensors of a language model are no longer in its blocks: the
loss upcasts the logits to fp32 and keeps their log-softmax for backward (batch x seq x vocabulary x 4 bytes:
1 GiB for 8192 tokens of a 32000-token vocabulary), on top of the logits themselves. ``chunked_cross_entropy``
computes the loss over ``chunk_tokens`` tokens at a time, each chunk checkpointed: forward keeps only the final
hidden states (batch x seq x hidden), and backward recomputes one chunk's logits at a time. The price is one
more matmul of the head per step.

``apply_chunked_loss(model)`` switches a model's loss to it: memtrain's ``GPT`` and the Hugging Face causal LMs
whose head is a plain linear layer on the last hidden state (see ``HF_MODEL_TYPES``). A model whose loss is
chunked returns no logits when it is given labels (``outputs.logits`` is ``None``): not holding them is the point.
Without labels, or with gradients off (evaluation, generation), the model's own forward runs unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.errors import ConfigError

# Hugging Face model types whose causal-LM forward is: decoder -> lm_head(last hidden state) -> ForCausalLMLoss,
# with no logit scaling or soft-capping in between. Parity with each is tested (tests/test_loss.py).
HF_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
    # fp32 logits for the loss, as Hugging Face and memtrain's GPT compute it: a bf16 softmax loses precision.
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
                          *, chunk_tokens: int = 1024, ignore_index: int = -100) -> torch.Tensor:
    """The summed cross-entropy of ``head(hidden)`` against ``labels``, ``chunk_tokens`` positions at a time.

    Equals ``F.cross_entropy(head(hidden).float().flatten(0, -2), labels.flatten(), reduction="sum")`` (fp32:
    within float rounding), while saving for backward only ``hidden``: each chunk's logits are recomputed in
    backward. Divide by the number of labels that are not ``ignore_index`` for the mean.

    Args:
        hidden: (..., hidden) final hidden states.
        head: maps hidden states to logits, e.g. the model's output ``nn.Linear``.
        labels: (...) target ids, ``ignore_index`` where no loss is wanted; already aligned with ``hidden``.
        chunk_tokens: positions per chunk: smaller holds less at once, larger runs fewer, bigger matmuls.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1. To resolve this error, pass "
                          "e.g. chunk_tokens=1024.")
    if hidden.shape[:-1] != labels.shape:
        raise ConfigError(f"hidden states of shape {tuple(hidden.shape)} do not match labels of shape "
                          f"{tuple(labels.shape)}. To resolve this error, pass one label per position.")
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if flat_labels.numel() == 0:  # an empty batch: a zero loss that backward can still run through
        return head(flat_hidden).float().sum() * 0
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_labels.numel(), chunk_tokens):
        stop = start + chunk_tokens
        total = total + checkpoint(_chunk_loss, head, flat_hidden[start:stop], flat_labels[start:stop], ignore_index,
                                   use_reentrant=False)
    return total


# Arguments of a Hugging Face causal LM's forward that belong to its loss or its logits, not to its decoder.
_LOSS_ARGUMENTS = ("num_items_in_batch", "shift_labels", "ignore_index")
_LOGITS_ARGUMENTS = ("logits_to_keep", "num_logits_to_keep")


class _HFChunkedForward:
    """A Hugging Face causal LM's forward with the loss chunked; its own forward when there is nothing to train."""

    def __init__(self, model: nn.Module, original: Callable[..., Any], had_instance_forward: bool,
                 chunk_tokens: int):
        self.model, self.original = model, original
        self.had_instance_forward, self.chunk_tokens = had_instance_forward, chunk_tokens
        self.__wrapped__ = original  # inspect.signature(model.forward) shows the model's own arguments
        self._signature = inspect.signature(original)
        from transformers import modeling_outputs

        # The output classes the model's own forward returns (GPT-2's carries cross-attentions), and their fields
        # (read here: torch.compile cannot trace dataclasses.fields).
        self._outputs = {cls: tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("loss", "logits"))
                         for cls in (modeling_outputs.CausalLMOutputWithPast,
                                     modeling_outputs.CausalLMOutputWithCrossAttentions)}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The loss's own arguments (Hugging Face passes its **kwargs to both the decoder and the loss).
        loss_arguments = {name: kwargs.pop(name) for name in _LOSS_ARGUMENTS if name in kwargs}
        try:
            arguments = dict(self._signature.bind(*args, **kwargs).arguments)
        except TypeError:  # arguments the model's forward does not take: its own error says which
            return self.original(*args, **kwargs, **loss_arguments)
        for name, parameter in self._signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        labels = arguments.pop("labels", None)
        keep = [arguments.pop(name) for name in _LOGITS_ARGUMENTS if name in arguments]
        if labels is None or not torch.is_grad_enabled() or any(k not in (0, None) for k in keep):
            # Nothing to train, or a loss on some positions only: the model's own forward, unchanged.
            return self.original(*args, **kwargs, **loss_arguments)
        return_dict = arguments.pop("return_dict", None)
        model = self.model
        outputs = getattr(model, model.base_model_prefix)(**arguments)
        ignore_index = loss_arguments.get("ignore_index", -100)
        shift_labels = loss_arguments.get("shift_labels")
        if shift_labels is None:
            # Hugging Face's ForCausalLMLoss: position t predicts label t + 1; the last position predicts nothing.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = outputs.last_hidden_state
        total = chunked_cross_entropy(hidden, output_head(model), shift_labels.to(hidden.device),
                                      chunk_tokens=self.chunk_tokens, ignore_index=ignore_index)
        num_items = loss_arguments.get("num_items_in_batch")
        if num_items is None:
            num_items = (shift_labels != ignore_index).sum()
        loss = total / (num_items.to(total.device) if torch.is_tensor(num_items) else num_items)
        past, cross = self._outputs
        cls = cross if hasattr(outputs, "cross_attentions") else past
        result = cls(loss=loss, logits=None, **{name: getattr(outputs, name, None) for name in self._outputs[cls]})
        return result.to_tuple() if return_dict is False else result


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``torch.compile``'s and DDP's wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _hf_problems(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    problems = []
    if model_type not in HF_MODEL_TYPES:
        problems.append(f"apply_chunked_loss does not know Hugging Face model type {model_type!r}: its forward may "
                        "scale or cap the logits before the loss. To resolve this error, use one of "
                        f"{sorted(HF_MODEL_TYPES)}, or compute the loss with chunked_cross_entropy yourself.")
    if not isinstance(head, nn.Linear):
        problems.append(f"{type(model).__name__} has no linear output head (get_output_embeddings() gave "
                        f"{type(head).__name__}). To resolve this error, pass a causal language model "
                        "(e.g. LlamaForCausalLM), not a base model.")
    if not isinstance(getattr(model, getattr(model, "base_model_prefix", ""), None), nn.Module):
        problems.append(f"{type(model).__name__} has no decoder at .{getattr(model, 'base_model_prefix', None)}. "
                        "To resolve this error, pass a causal language model (e.g. LlamaForCausalLM).")
    elif not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()):
        import transformers

        problems.append(f"{type(model).__name__}.forward of transformers {transformers.__version__} takes no loss "
                        "arguments (num_items_in_batch, shift_labels). To resolve this error, upgrade transformers "
                        "(pip install -U 'transformers>=4.48'), or train without a chunked loss.")
    return problems


def _is_gpt(model: nn.Module) -> bool:
    from memtrain.models import GPT  # lazily: GPT.forward imports this module

    return isinstance(model, GPT)


def output_head(model: nn.Module) -> nn.Module:
    """The module ``chunked_cross_entropy`` recomputes in backward: GPT's ``head``, a Hugging Face model's
    output embeddings."""
    model = _unwrap(model)
    return model.head if _is_gpt(model) else model.get_output_embeddings()


def supports_chunked_loss(model: nn.Module) -> bool:
    """Whether ``apply_chunked_loss`` knows how to chunk this model's loss (inside a compile or DDP wrapper too)."""
    model = _unwrap(model)
    return _is_gpt(model) or not _hf_problems(model)


def chunked_loss_kind(model: nn.Module) -> Literal["gpt", "hf"] | None:
    """How a training loop must call ``model`` when its loss is chunked now: ``"gpt"`` (``model(x, y,
    reduction="sum")``) or ``"hf"`` (``model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=1)``);
    None when it is not."""
    if chunk_tokens_of(model) is None:
        return None
    return "gpt" if _is_gpt(_unwrap(model)) else "hf"


def chunk_tokens_of(model: nn.Module) -> int | None:
    """The ``chunk_tokens`` of ``model``'s chunked loss, or None when its loss is not chunked."""
    model = _unwrap(model)
    if _is_gpt(model):
        return model.loss_chunk_tokens
    forward = model.__dict__.get("forward")
    return forward.chunk_tokens if isinstance(forward, _HFChunkedForward) else None


def apply_chunked_loss(model: nn.Module, *, chunk_tokens: int = 1024) -> None:
    """Computes ``model``'s training loss with ``chunked_cross_entropy``: the fp32 logits are never held whole.

    With every block checkpointed, this is what is left to cut: on the 8-layer Llama of
    ``benchmarks/bench_checkpointing.py`` (batch 8 x 256, vocabulary 2048) the saved bytes fall from 8.9x fewer than
    no checkpointing to 15x fewer (``pytest tests/test_loss.py -k ten_x -s``). The loss and gradients equal the
    model's own within float rounding. Given labels, the model returns no logits (``None``); without labels or
    with gradients off it runs its own forward. Calling again changes ``chunk_tokens``;
    ``remove_chunked_loss(model)`` undoes it.

    Args:
        model: memtrain's ``GPT``, or a Hugging Face causal LM of a type in ``HF_MODEL_TYPES``.
        chunk_tokens: positions whose logits exist at once, in forward and in backward.

    Raises:
        ConfigError: a bad ``chunk_tokens``, or a model whose loss this does not know how to chunk.
    """
    problems = []
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        problems.append(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1. To resolve this error, pass e.g. "
                        "chunk_tokens=1024.")
    model = _unwrap(model)  # a compiled model: the module it compiles, so the compiled forward runs the chunks
    if not _is_gpt(model):
        problems += _hf_problems(model)
    ConfigError.raise_if(problems)
    remove_chunked_loss(model)
    if _is_gpt(model):
        model.loss_chunk_tokens = chunk_tokens
        return
    had_instance_forward = "forward" in model.__dict__
    model.forward = _HFChunkedForward(model, model.forward, had_instance_forward, chunk_tokens)  # type: ignore[method-assign]


def remove_chunked_loss(model: nn.Module) -> bool:
    """Undoes ``apply_chunked_loss``; returns whether there was anything to undo."""
    model = _unwrap(model)
    if _is_gpt(model):
        was, model.loss_chunk_tokens = model.loss_chunk_tokens is not None, None
        return was
    forward = model.__dict__.get("forward")
    if not isinstance(forward, _HFChunkedForward):
        return False
    if forward.had_instance_forward:
        model.forward = forward.original  # type: ignore[method-assign]
    else:
        del model.forward
    return True
