"""Chunked cross-entropy: the head's logits ``chunk_tokens`` tokens at a time, never held whole.

With every block checkpointed, the largest saved tensors of a language model are no longer in its blocks: the
loss upcasts the logits to fp32 and keeps their log-softmax for backward (batch x seq x vocabulary x 4 bytes:
1 GiB for 8192 tokens of a 32000-token vocabulary), on top of the logits themselves. ``chunked_cross_entropy``
computes the loss over ``chunk_tokens`` tokens at a time with one of two kernels (``chunked_loss_implementation``
says which, and why): torch >= 2.13's ``F.linear_cross_entropy`` chunked op, which computes the gradients in
forward (2.93 GiB -> 206 MiB at 0.85x the time on the CPU, ``benchmarks/bench_loss.py``); or memtrain's, which
keeps only the final hidden states and recomputes one chunk's logits at a time in backward (268 MiB at 1.33x: one
more matmul of the head), for heads torch's op cannot take and under ``torch.compile``.

``apply_chunked_loss(model)`` switches a model's loss to it: memtrain's ``GPT`` and the Hugging Face causal LMs
whose head is a plain linear layer on the last hidden state, its logits then scaled or soft-capped or neither
(``memtrain.logit_steps`` reads them from each model's forward: Gemma-2/3, Cohere, Granite; applied to each chunk's
logits, in forward and in the recompute, by a ``LogitsHead``, which takes memtrain's kernel). A model whose loss is chunked returns no logits when it is
given labels (``outputs.logits`` is ``None``): not holding them is the point. Without labels, or with gradients off
(evaluation, generation), the model's own forward runs unchanged.

``language_model_loss(model, x, y)`` is the training loop's loss for any of these models, chunked or not. Given
``kept`` (the labels that are not -100, which the loop counts on the host before a batch's copy to the device), the
chunked loss gathers only those positions before the head (``kept_positions``): a prompt or padding then costs no
matmul of the head and no logits, with no wait for the device (``torch.nonzero_static`` of the host's count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.errors import ConfigError
from memtrain.logit_steps import LogitOp, Steps, Unrecognised, logit_steps
from memtrain.unwrap import unwrap_model


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """What a causal LM does to its head's logits before the loss, step by step in its forward's order and with its
    forward's ops (so that each chunk's logits round as the whole logits do): ``("multiply", s)`` is ``logits * s``,
    ``("divide", s)`` ``logits / s``, ``("softcap", c)`` ``tanh(logits / c) * c``.

    Example:
        >>> LogitTransform((("softcap", 30.0, "config.final_logit_softcapping"),))(torch.tensor([60.0]))
        tensor([28.9208])
    """

    steps: tuple[tuple[LogitOp, float, str], ...]  # (op, value, where the model reads the value: for reasons)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        for op, value, _ in self.steps:
            if op == "multiply":
                logits = logits * value
            elif op == "divide":
                logits = logits / value
            else:
                logits = torch.tanh(logits / value) * value
        return logits

    def __str__(self) -> str:
        text = {"multiply": "logits * {v}", "divide": "logits / {v}", "softcap": "tanh(logits / {v}) * {v}"}
        return ", then ".join(f"{text[op].format(v=value)} ({source})" for op, value, source in self.steps)


class LogitsHead(nn.Module):
    """An output layer followed by its model's ``LogitTransform``: the head ``chunked_cross_entropy`` calls (and
    recomputes in backward) for a model that scales or soft-caps its logits. Its parameters are the layer's."""

    def __init__(self, head: nn.Module, transform: LogitTransform):
        super().__init__()
        self.head, self.transform = head, transform

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform(self.head(hidden))


def logit_transform(model: nn.Module, steps: Steps | None = None) -> LogitTransform | None:
    """What a Hugging Face causal LM whose forward memtrain reads (``memtrain.logit_steps``) does to its logits
    between the head and the loss, the values read from the model as its forward reads them; None when nothing (or
    for another model). ``steps``: the forward's, read before (a chunked forward reads them once, so no source is
    read inside a compiled step)."""
    model = unwrap_model(model, peft=True)
    found = tuple((op, value, source) for op, source in (logit_transform_steps(model) if steps is None else steps)
                  if (value := operator.attrgetter(source)(model)) is not None)  # None: the forward skips it
    return LogitTransform(found) if found else None


def logit_transform_steps(model: nn.Module) -> Steps:
    """The steps a Hugging Face causal LM's forward takes on its logits (``memtrain.logit_steps``); none for another
    model or a forward it does not read."""
    model = unwrap_model(model, peft=True)
    if not hasattr(model, "config"):
        return ()
    steps = logit_steps(type(model))
    return () if isinstance(steps, Unrecognised) else steps


LossImplementation = Literal["torch", "memtrain"]


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
    # fp32 logits for the loss, as Hugging Face and memtrain's GPT compute it: a bf16 softmax loses precision.
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked_loss_implementation(head: Callable[[torch.Tensor], torch.Tensor], *,
                                dtype: torch.dtype | None = None) -> tuple[LossImplementation, str]:
    """Which kernel ``chunked_cross_entropy`` runs for ``head`` here, and why (for a run's reasons).

    ``"torch"``: ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions`` (torch >= 2.13): its chunked op
    computes each chunk's logits once, in forward, and keeps the gradients for backward, so backward does no
    matmul of the head again; it takes the head's weight and bias, never calling the head. ``"memtrain"``:
    memtrain's chunks, recomputed in backward (one more matmul of the head), for any callable head.

    torch's op is used where it gives the same result at no extra cost: eagerly, for a plain ``nn.Linear`` head
    without forward hooks (a LoRA head, a quantised linear or an activation offloader's hook on the head need the
    head's own forward to run; a ``LogitsHead``'s scaling or soft-capping of the logits is no part of torch's op),
    except with bf16/fp16 inputs on the CPU. Measured on this CPU
    (``benchmarks/bench_loss.py``, 8192 tokens, hidden 512, vocabulary 32000): in fp32 torch's took 0.85x the
    whole-logits loss's time at 206 MiB, memtrain's 1.33x at 268 MiB; under bf16 autocast torch's took 2.8x
    (its per-token path recomputes in backward, and CPU half matmuls are emulated) against memtrain's 1.3x. Under
    ``torch.compile`` (torch 2.13, checked with ``aot_eager``) the op breaks the graph at the warning with which it
    forces ``allow_retain_graph=True``; with that option given it compiles, but keeps a second copy of its
    gradients (tokens x hidden + the head's weight). memtrain's chunks compile into the graph with neither cost.

    Args:
        head: the output layer.
        dtype: the dtype of the head's matmul; default: autocast's where it is on for the head's device (it is
            inside the training step), else the weight's. A run's reasons pass its autocast dtype.
    """
    if isinstance(head, LogitsHead):
        return "memtrain", (f"the model transforms its logits after the head: {head.transform}; torch's op computes "
                            "the cross-entropy of the head's own logits and cannot apply it")
    if not hasattr(F, "linear_cross_entropy") or not hasattr(nn, "LinearCrossEntropyOptions"):
        return "memtrain", f"torch {torch.__version__} has no chunked F.linear_cross_entropy (torch >= 2.13 has)"
    if torch.compiler.is_compiling():
        return "memtrain", ("under torch.compile torch's chunked op breaks the graph (or, with allow_retain_graph, "
                            "copies its gradients once more); memtrain's chunks compile into the graph")
    if type(head) is not nn.Linear:
        return "memtrain", (f"the head is a {type(head).__name__}, not a plain nn.Linear: torch's op would use its "
                            "weight without running its forward")
    if head._forward_pre_hooks or head._forward_hooks:
        return "memtrain", ("the head has forward hooks (e.g. activation offload's), which torch's op, never "
                            "calling the head, would skip")
    device_type = head.weight.device.type
    if dtype is None:
        autocast, autocast_dtype = _autocast_state(device_type)
        dtype = autocast_dtype if autocast else head.weight.dtype
    if device_type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return "memtrain", (f"torch's chunked op with {str(dtype).replace('torch.', '')} inputs on the CPU took 2.8x "
                            "the whole-logits loss's time, memtrain's 1.3x (benchmarks/bench_loss.py --precision bf16)")
    return "torch", ("torch's F.linear_cross_entropy computes each chunk's logits once and its gradients in forward "
                     "(no second matmul of the head in backward)")


def chunked_cross_entropy(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
                          *, chunk_tokens: int = 1024, ignore_index: int = -100,
                          implementation: LossImplementation | Literal["auto"] = "auto",
                          kept: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of ``head(hidden)`` against ``labels``, ``chunk_tokens`` positions at a time.

    Equals ``F.cross_entropy(head(hidden).float().flatten(0, -2), labels.flatten(), reduction="sum")`` (fp32:
    within float rounding) without holding the logits of more than ``chunk_tokens`` positions at once. Divide by
    the number of labels that are not ``ignore_index`` for the mean.

    Two kernels (``chunked_loss_implementation`` says which runs and why):

    - ``"torch"`` (torch >= 2.13, eager, a plain ``nn.Linear`` head): ``F.linear_cross_entropy``'s chunked op.
      It computes the gradients in forward and holds them until backward (hidden x tokens for the input, the
      head's weight gradient), which ``saved_tensors_hooks`` do not see: a ``MemoryMeter`` counts no saved
      activation for the loss. In fp32 the loss is summed inside the op; with bf16/fp16 inputs (autocast, which
      this applies to the head's inputs as it would to the head's matmul) it returns per-token losses summed here
      in fp32, since a half-precision sum of thousands of losses keeps three digits (fp16 overflows at 65504).
    - ``"memtrain"``: the forward computes the loss chunk by chunk without a graph and saves ``hidden`` and
      ``labels`` only; backward recomputes one chunk's logits at a time and writes each chunk's gradient into
      one preallocated gradient of ``hidden`` (a slice's own backward would allocate a zero-filled gradient of
      the whole ``hidden`` per chunk). The head must be deterministic (no dropout): it runs again in backward.
      Under ``torch.compile`` each chunk is a non-reentrant checkpoint of a ``split`` of ``hidden`` instead,
      which traces into the compiled graph.

    Args:
        hidden: (..., hidden) final hidden states.
        head: maps hidden states to logits, e.g. the model's output ``nn.Linear``, or a ``LogitsHead`` of it for
            a model that scales or soft-caps its logits (the loss is then that of the transformed logits).
        labels: (...) target ids, ``ignore_index`` where no loss is wanted; already aligned with ``hidden``.
        chunk_tokens: positions per chunk: smaller holds less at once, larger runs fewer, bigger matmuls.
        implementation: ``"auto"`` (``chunked_loss_implementation``), ``"torch"`` or ``"memtrain"``.
        kept: the number of labels that are not ``ignore_index``, counted on the host (a training loop counts a
            batch's before copying it to the device). Given, only those positions reach the head: the ignored ones
            (a prompt, padding) cost no matmul, no logits and no saved hidden state. It must be the count: the
            positions are gathered by ``torch.nonzero_static`` of that size, which needs no wait for the device
            (a device-side count would stall the host until the forward had run), and which is not checked (a
            check would read the device): a smaller count drops kept rows from the loss, a larger one fails to
            index. Ignored under ``torch.compile`` (a size that changes with each batch would recompile the graph).

    Raises:
        ConfigError: a bad ``chunk_tokens`` or ``kept``, shapes that do not match, or ``implementation="torch"``
            where torch's op cannot run (no ``F.linear_cross_entropy``, or a head that is not an ``nn.Linear``).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1. To resolve this error, pass "
                          "e.g. chunk_tokens=1024.")
    if hidden.shape[:-1] != labels.shape:
        raise ConfigError(f"hidden states of shape {tuple(hidden.shape)} do not match labels of shape "
                          f"{tuple(labels.shape)}. To resolve this error, pass one label per position.")
    if implementation not in ("auto", "torch", "memtrain"):
        raise ConfigError(f"implementation={implementation!r} must be 'auto', 'torch' or 'memtrain'. To resolve "
                          "this error, pass implementation='auto' (chunked_loss_implementation says which runs).")
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if kept is not None and not torch.compiler.is_compiling():
        flat_hidden, flat_labels = kept_positions(flat_hidden, flat_labels, kept, ignore_index)
    if flat_labels.numel() == 0:  # an empty batch: a zero loss that backward can still run through
        return head(flat_hidden).float().sum() * 0
    if implementation == "auto":
        implementation = chunked_loss_implementation(head)[0]
    elif implementation == "torch" and not (hasattr(F, "linear_cross_entropy") and isinstance(head, nn.Linear)):
        raise ConfigError(f"implementation='torch' needs torch >= 2.13's F.linear_cross_entropy (torch "
                          f"{torch.__version__}) and an nn.Linear head (got {type(head).__name__}). To resolve this "
                          "error, pass implementation='auto'.")
    if implementation == "torch":
        return _torch_chunked(flat_hidden, head, flat_labels, chunk_tokens, ignore_index)  # type: ignore[arg-type]
    if torch.compiler.is_compiling():
        total = flat_hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(flat_hidden.split(chunk_tokens), flat_labels.split(chunk_tokens), strict=True):
            total = total + checkpoint(_chunk_loss, head, h, y, ignore_index, use_reentrant=False)
        return total
    params = [p for p in head.parameters()] if isinstance(head, nn.Module) else []
    return _ChunkedCrossEntropy.apply(flat_hidden, flat_labels, head, chunk_tokens, ignore_index, *params)


def kept_positions(hidden: torch.Tensor, labels: torch.Tensor, kept: int, ignore_index: int = -100
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``hidden`` (tokens, hidden) and ``labels`` (tokens,) whose label is not ``ignore_index``, in
    order: ``kept`` of them, counted on the host, so that gathering them needs no wait for the device.

    Raises:
        ConfigError: ``kept`` not a count in [0, tokens].
    """
    if isinstance(kept, bool) or not isinstance(kept, int) or not 0 <= kept <= labels.numel():
        raise ConfigError(f"kept={kept!r} must be the number of labels that are not ignore_index, in [0, "
                          f"{labels.numel()}]. To resolve this error, pass int((labels != ignore_index).sum()) "
                          "counted before the batch goes to the device, or kept=None.")
    if kept == labels.numel():
        return hidden, labels
    index = torch.nonzero_static(labels != ignore_index, size=kept).squeeze(1)
    return hidden.index_select(0, index), labels.index_select(0, index)


def _torch_chunked(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk_tokens: int,
                   ignore_index: int) -> torch.Tensor:
    weight, bias = head.weight, head.bias
    device_type = hidden.device.type
    autocast = _autocast_state(device_type)[0]
    if autocast:
        # What autocast does to the head's matmul: both operands in the autocast dtype. Inside, the op accumulates
        # in fp32 and must not be cast again.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens)
    half = hidden.dtype in (torch.float16, torch.bfloat16)
    with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
        loss = F.linear_cross_entropy(hidden, weight, labels, linear_bias=bias, ignore_index=ignore_index,
                                      reduction="none" if half else "sum", options=options)
    return loss.float().sum() if half else loss.float()


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    """(enabled, dtype) of autocast for a device type; off for types autocast does not know (e.g. meta)."""
    if not torch.amp.is_autocast_available(device_type):
        return False, torch.float32
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@torch.no_grad()
def _cross_entropy_grad(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        grad_total: torch.Tensor) -> torch.Tensor:
    """``grad_total * d(sum of F.cross_entropy(logits.float(), labels))/d(logits)``, in one fp32 buffer of the
    logits' shape: ``softmax - one_hot(label)`` per row, zero on ignored rows.

    Autograd through ``F.cross_entropy`` would hold three such buffers at once (the saved log-softmax, its
    gradient and the logits' gradient); computed in place, one (two under autocast: the fp32 copy and its cast).
    """
    grad = logits.detach().float()  # fp32 logits: the buffer itself, reused (backward of the head never reads it)
    # softmax in place, as torch's own chunked kernel does (logsumexp would allocate a second such buffer); the
    # normalisation, the ignored rows and grad_total are one multiply
    grad.sub_(grad.amax(dim=-1, keepdim=True)).exp_()
    weight = (labels != ignore_index).to(grad.dtype).unsqueeze(-1) * grad_total
    grad.mul_(weight / grad.sum(dim=-1, keepdim=True))
    # Ignored rows scatter their zero weight into column 0: their label (ignore_index, which may be >= the
    # vocabulary, e.g. ignore_index=vocab_size) is no column to index. A label outside [0, vocab) that is not
    # ignored never gets here: forward's F.cross_entropy refused it.
    grad.scatter_add_(-1, labels.masked_fill(labels == ignore_index, 0).unsqueeze(-1), -weight)
    return grad.to(logits.dtype)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """memtrain's kernel: chunks without a graph in forward, recomputed in backward into one gradient buffer."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, labels: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                chunk_tokens: int, ignore_index: int, *params: torch.Tensor) -> torch.Tensor:
        device_type = hidden.device.type
        # Backward runs outside the caller's autocast region: the recompute restores it, so each chunk's logits
        # round as they did in forward (as torch.utils.checkpoint does).
        ctx.autocast = (device_type, *_autocast_state(device_type))
        ctx.head, ctx.chunk_tokens, ctx.ignore_index, ctx.params = head, chunk_tokens, ignore_index, params
        ctx.save_for_backward(hidden, labels)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, labels.numel(), chunk_tokens):
            stop = start + chunk_tokens
            total += _chunk_loss(head, hidden[start:stop], labels[start:stop], ignore_index)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, labels = ctx.saved_tensors
        device_type, autocast, dtype = ctx.autocast
        wants_hidden = ctx.needs_input_grad[0]
        wanted = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[5 + i]]
        # One gradient of hidden, each chunk writing its own rows: no full-size zeros per chunk.
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_params: list[torch.Tensor | None] = [None] * len(ctx.params)
        for start in range(0, labels.numel(), ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            inputs = [ctx.params[i] for i in wanted]
            # Identity hooks: the recompute's saved tensors live for this chunk's backward only, so an outer
            # saved_tensors_hooks (an estimate's meter, which spans backward) must not count them, as it does not
            # count torch.utils.checkpoint's recompute.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same), \
                    (torch.autocast(device_type, dtype=dtype, cache_enabled=False) if autocast
                     else contextlib.nullcontext()):
                h = hidden[start:stop].detach().requires_grad_(wants_hidden)
                logits = ctx.head(h)
            if wants_hidden:
                inputs.insert(0, h)
            if not inputs:
                break
            grad_logits = _cross_entropy_grad(logits, labels[start:stop], ctx.ignore_index, grad_total)
            grads = list(torch.autograd.grad(logits, inputs, grad_logits, allow_unused=True))
            if wants_hidden:
                grad_hidden[start:stop].copy_(grads.pop(0))
            for i, g in zip(wanted, grads, strict=True):
                if g is not None:
                    grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
            # Drop this chunk's gradients (a weight gradient of the head each) before the next chunk's backward:
            # its softmax is the peak, and there only the running sum must exist.
            grads = g = inputs = logits = grad_logits = h = None
        return (grad_hidden, None, None, None, None, *grad_params)


# Arguments of a Hugging Face causal LM's forward that belong to its loss or its logits, not to its decoder.
_LOSS_ARGUMENTS = ("num_items_in_batch", "shift_labels", "ignore_index")
KEPT_ARGUMENT = "kept_labels"  # memtrain's own: chunked_cross_entropy's kept (never passed to the model's forward)
_LOGITS_ARGUMENTS = ("logits_to_keep", "num_logits_to_keep")


class _HFChunkedForward:
    """A Hugging Face causal LM's forward with the loss chunked; its own forward when there is nothing to train."""

    def __init__(self, model: nn.Module, original: Callable[..., Any], had_instance_forward: bool,
                 chunk_tokens: int):
        self.model, self.original = model, original
        self.had_instance_forward, self.chunk_tokens = had_instance_forward, chunk_tokens
        self._logits_head: LogitsHead | None = None
        self._steps = logit_transform_steps(model)
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
        kept = kwargs.pop(KEPT_ARGUMENT, None)
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
        total = chunked_cross_entropy(hidden, self.loss_head(), shift_labels.to(hidden.device),
                                      chunk_tokens=self.chunk_tokens, ignore_index=ignore_index, kept=kept)
        num_items = loss_arguments.get("num_items_in_batch")
        if num_items is None:
            num_items = (shift_labels != ignore_index).sum()
        loss = total / (num_items.to(total.device) if torch.is_tensor(num_items) else num_items)
        past, cross = self._outputs
        cls = cross if hasattr(outputs, "cross_attentions") else past
        result = cls(loss=loss, logits=None, **{name: getattr(outputs, name, None) for name in self._outputs[cls]})
        return result.to_tuple() if return_dict is False else result

    def loss_head(self) -> nn.Module:
        """The model's output layer, or for a model that transforms its logits a ``LogitsHead`` of it, read from
        the model at each call as its forward reads them (an adapter put on the head later is the one that runs).
        The same ``LogitsHead`` while neither changes: an estimate wraps its forward once, then runs the step."""
        head, transform = self.model.get_output_embeddings(), logit_transform(self.model, self._steps)
        if transform is None:
            return head
        cached = self._logits_head
        if cached is None or cached.head is not head or cached.transform != transform:
            self._logits_head = cached = LogitsHead(head, transform)
        return cached


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The output head of memtrain's GPT or of a Hugging Face model (None for other models)."""
    model = unwrap_model(model, peft=True)
    if _is_gpt(model):
        return model.head
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None




def _hf_problems(model: nn.Module) -> list[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    problems = []
    steps = logit_steps(type(model)) if hasattr(model, "config") else Unrecognised("it has no config")
    if {"loss_function", "_loss_function"} & set(vars(model)):  # the chunked forward computes the cross-entropy
        steps = Unrecognised("its own loss_function replaces the class's cross-entropy")
    if isinstance(steps, Unrecognised):
        problems.append(f"apply_chunked_loss does not know how {type(model).__name__} computes its loss: its forward "
                        f"is not Llama's (decoder, linear head, at most a scaling or soft-capping of the logits, "
                        f"cross-entropy): {steps}. To resolve this error, compute the loss with "
                        "chunked_cross_entropy yourself, or train without a chunked loss (chunked_loss=False).")
        steps = ()
    for _, source in steps:
        try:
            value = operator.attrgetter(source)(model)
        except AttributeError:
            problems.append(f"{type(model).__name__} has no {source}, by which its forward scales or caps the "
                            "logits (an edited model?). To resolve this error, give the model that attribute, or "
                            "train without a chunked loss (chunked_loss=False).")
            continue
        if isinstance(value, torch.Tensor) and value.requires_grad:  # the chunks' backward gives the head's only
            problems.append(f"{type(model).__name__}'s {source}, by which its forward scales or caps the logits, "
                            "is trainable, and the chunked loss would give it no gradient. To resolve this error, "
                            f"freeze it ({source}.requires_grad_(False)), or train without a chunked loss "
                            "(chunked_loss=False).")
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
    """memtrain's GPT (``memtrain.models.GPT``), known by its class attribute ``memtrain_gpt``, so that this
    module imports nothing from ``memtrain.models`` (which imports it)."""
    return getattr(type(model), "memtrain_gpt", False) is True


def output_head(model: nn.Module) -> nn.Module:
    """The module ``chunked_cross_entropy`` recomputes in backward: GPT's ``head``, a Hugging Face model's
    output embeddings, or a ``LogitsHead`` of them where the model scales or soft-caps its logits."""
    model = unwrap_model(model, peft=True)
    if _is_gpt(model):
        return model.head
    forward = model.__dict__.get("forward")
    if isinstance(forward, _HFChunkedForward):
        return forward.loss_head()
    head, transform = model.get_output_embeddings(), logit_transform(model)
    return head if transform is None else LogitsHead(head, transform)


def supports_chunked_loss(model: nn.Module) -> bool:
    """Whether ``apply_chunked_loss`` knows how to chunk this model's loss (inside a compile or DDP wrapper too)."""
    model = unwrap_model(model, peft=True)
    return _is_gpt(model) or not _hf_problems(model)


def chunked_loss_kind(model: nn.Module) -> Literal["gpt", "hf"] | None:
    """How a training loop must call ``model`` when its loss is chunked now: ``"gpt"`` (``model(x, y,
    reduction="sum")``) or ``"hf"`` (``model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=1)``);
    None when it is not."""
    if chunk_tokens_of(model) is None:
        return None
    return "gpt" if _is_gpt(unwrap_model(model, peft=True)) else "hf"


def chunk_tokens_of(model: nn.Module) -> int | None:
    """The ``chunk_tokens`` of ``model``'s chunked loss, or None when its loss is not chunked."""
    model = unwrap_model(model, peft=True)
    if _is_gpt(model):
        return model.loss_chunk_tokens
    forward = model.__dict__.get("forward")
    return forward.chunk_tokens if isinstance(forward, _HFChunkedForward) else None


def apply_chunked_loss(model: nn.Module, *, chunk_tokens: int = 1024) -> None:
    """Computes ``model``'s training loss with ``chunked_cross_entropy``: the fp32 logits are never held whole.

    With every block checkpointed, this is what is left to cut: on the 8-layer Llama of
    ``benchmarks/bench_checkpointing.py`` (batch 8 x 256, vocabulary 2048) the saved bytes fall from 8.9x fewer than
    no checkpointing to 15x fewer (``pytest tests/test_loss.py -k ten_x -s``). The loss and gradients equal the
    model's own within float rounding; a model that scales or soft-caps its logits (``memtrain.logit_steps``) has them
    transformed a chunk at a time, as its forward reads them, by memtrain's kernel. Given labels, the model returns
    no logits (``None``); without labels or with gradients off it runs its own forward. Calling again changes
    ``chunk_tokens``; ``remove_chunked_loss(model)`` undoes it.

    Args:
        model: memtrain's ``GPT``, or a Hugging Face causal LM whose forward is Llama's but for steps on the logits
            (``memtrain.logit_steps``: 51 classes of transformers 5.25).
        chunk_tokens: positions whose logits exist at once, in forward and in backward.

    Raises:
        ConfigError: a bad ``chunk_tokens``, or a model whose loss this does not know how to chunk.
    """
    problems = []
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        problems.append(f"chunk_tokens={chunk_tokens!r} must be an integer >= 1. To resolve this error, pass e.g. "
                        "chunk_tokens=1024.")
    # A compiled model: the module it compiles, so the compiled forward runs the chunks; a PEFT model: its causal
    # LM, whose forward PEFT calls.
    model = unwrap_model(model, peft=True)
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
    model = unwrap_model(model, peft=True)
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


def language_model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                        position_ids: torch.Tensor | None = None, *, kept: int | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy on fp32 logits (labels of -100 ignored); memtrain GPT or Hugging Face.

    ``y`` is already shifted (``y[t]`` follows ``x[t]``). A model with ``apply_chunked_loss`` computes it from its
    hidden states a chunk of tokens at a time, never holding the whole batch's logits; given ``kept`` (the labels
    that are not -100, counted on the host: ``chunked_cross_entropy``), only those positions reach its head.
    ``position_ids`` (packed rows, ``memtrain.data.PackedRows``) restart at each document, so a Hugging Face model
    attends within it.
    """
    kind = chunked_loss_kind(model)  # it looks inside DDP's and torch.compile's wrappers
    if kind == "gpt":
        return model(x, y, reduction="sum") if kept is None else model(x, y, reduction="sum", kept=kept)
    positions = {} if position_ids is None else {"position_ids": position_ids}
    if kind == "hf" and torch.is_grad_enabled():
        counted = {} if kept is None else {KEPT_ARGUMENT: kept}
        return model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=1, **positions, **counted).loss
    out = model(x, **positions)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
