"""QLoRA's 4-bit base: the frozen linear weights stored as NF4 through bitsandbytes, about 0.56 bytes a weight
instead of 2 (bf16) or 4 (fp32), at the cost of dequantising each weight to the compute dtype in every forward and
backward matmul.

What it does is what transformers' ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` does, done
here so it also applies to a model built from a config (--hf-config) and on the CPU: every ``nn.Linear`` but the
output head (transformers keeps ``lm_head`` unquantised too) becomes a ``bitsandbytes.nn.Linear4bit`` whose weight is
packed two 4-bit codes to a byte (uint8), with one fp32 absmax per block of 64 weights and the 16-entry NF4 code
book (no double quantisation: ``bnb_4bit_use_double_quant=False``, transformers' default). Of PEFT's
``prepare_model_for_kbit_training`` it keeps what changes the numbers: every base weight frozen, the weights outside
the quantised layers (embeddings, norms) in fp32 (memtrain loads them in fp32 already). It does not turn on
Hugging Face's gradient checkpointing (memtrain's planner chooses checkpointing) nor make the embedding's output
require grad (memtrain's checkpointing is non-reentrant, which does not need it).

On the meta device (``memtrain estimate`` and ``plan``) nothing can be quantised, so each layer becomes a
``Linear4bitStandIn``: the same stored bytes (the packed weight, absmax and code book as frozen parameters) and a
forward and backward that allocate what bitsandbytes' do (a dequantised weight in the compute dtype per matmul,
nothing saved for backward). bitsandbytes is not needed to plan.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memtrain.errors import ConfigError

QUANT_TYPES = ("nf4",)
BLOCK_SIZE = 64  # weights per absmax: bitsandbytes' and transformers' default for 4-bit
CODE_ENTRIES = 16  # the NF4 code book: 16 fp32 values, one copy per quantised layer (bitsandbytes makes one each)


def fsdp_shards_4bit() -> bool:
    """Whether this torch's FSDP2 shards the packed 4-bit codes (uint8 parameters): torch 2.12 and newer. Before it
    (pytorch#177844) ``fully_shard`` makes every sharded parameter require grad, which a uint8 one cannot, and its
    mixed precision would cast the codes to the gathered dtype."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)


@contextlib.contextmanager
def bitsandbytes_quiet() -> Iterator[None]:
    """bitsandbytes' logger at ERROR while it imports: its import logs the optional kernels it did not find (on a
    CPU, a 4-bit kernel from the Hugging Face Hub whose publisher it cannot verify), which nothing in a run acts on.
    peft imports it too, where it is installed."""
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def bitsandbytes() -> Any:
    """The bitsandbytes package, or a ConfigError naming the extra that installs it."""
    try:
        with bitsandbytes_quiet():
            import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("--quantize-base nf4 (QLoRA) needs the bitsandbytes package, which is not installed. To "
                          "resolve this error, run: pip install 'memtrain[qlora]' (or drop --quantize-base to train "
                          "LoRA on an unquantised base).") from None
    return bnb


def quantized_layers(model: nn.Module) -> list[str]:
    """The names of the linear layers ``quantize_base`` quantises: every ``nn.Linear`` but the output head (also
    LoRA's default targets, ``hf.lora_targets``)."""
    from memtrain.loss import output_embeddings

    head = output_embeddings(model)
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head]


def quantize_base(model: nn.Module, quant_type: str = "nf4", *, compute_dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> nn.Module:
    """Replaces the linear layers of ``model`` (but its output head) by 4-bit ones, frozen, in place; returns it.

    Args:
        quant_type: ``"nf4"``.
        compute_dtype: the dtype each matmul dequantises the weight to: the autocast dtype under mixed precision,
            else fp32 (bitsandbytes' ``bnb_4bit_compute_dtype``).
        device: where to quantise (the model's own device by default); a model on the meta device gets stand-ins.

    Raises:
        ConfigError: an unknown ``quant_type``; bitsandbytes missing (for a model not on the meta device).
    """
    if quant_type not in QUANT_TYPES:
        raise ConfigError(f"quant_type={quant_type!r} is not a 4-bit format memtrain quantises to. To resolve this "
                          f"error, pass one of {', '.join(QUANT_TYPES)}.")
    names = quantized_layers(model)
    on_meta = any(p.is_meta for p in model.parameters())
    bnb = None if on_meta else bitsandbytes()
    modules = dict(model.named_modules())
    for p in model.parameters():
        p.requires_grad_(False)  # prepare_model_for_kbit_training freezes the whole base
    for name in names:
        linear = modules[name]
        if on_meta:
            new = Linear4bitStandIn(linear.in_features, linear.out_features, linear.bias, compute_dtype)
        else:
            new = _bnb_linear(bnb, linear, compute_dtype, device or linear.weight.device)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)
    if not on_meta:
        model.is_loaded_in_4bit = True  # as transformers marks it: PEFT then wraps the layers in its 4-bit LoRA layer
    return model


def _bnb_linear(bnb: Any, linear: nn.Linear, compute_dtype: torch.dtype, device: Any) -> nn.Module:
    """``linear`` as a bitsandbytes ``Linear4bit`` quantised on ``device`` (NF4, blocks of 64, no double quant)."""
    new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=compute_dtype, compress_statistics=False, quant_type="nf4",
                            device="meta")
    # NOTE: on a CPU with AVX512-BF16, an eval-mode forward without grad repacks the weight in place into a layout
    # only the inference kernel reads, after which training forwards bypass autograd; memtrain evaluates between
    # training steps, so the repacking is switched off.
    new.support_avx512bf16_for_cpu = False
    weight = bnb.nn.Params4bit(linear.weight.detach(), requires_grad=False, blocksize=BLOCK_SIZE,
                               compress_statistics=False, quant_type="nf4", module=new)
    new.weight = weight.to(device)  # quantises
    new.register_load_state_dict_pre_hook(_load_quant_state)
    if linear.bias is not None:  # in the compute dtype, as bitsandbytes' first forward leaves it
        new.bias = nn.Parameter(linear.bias.detach().to(device, compute_dtype), requires_grad=False)
    return new


def _load_quant_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Loads a 4-bit layer's state dict (a checkpoint's, on --resume): the packed weight as any parameter, the
    quantisation state its ``state_dict`` wrote beside it (``weight.absmax``, ``weight.quant_map``,
    ``weight.quant_state.*``) into the layer's, which bitsandbytes' ``Linear4bit`` would refuse as unexpected
    keys. The shapes must match: the same layer quantised alike. (Under FSDP2 the weight is a DTensor shard and
    the state the layer's own; a sharded checkpoint holds none, the layer quantised alike at the start has it.)"""
    state = layer_quant_state(module)
    key = prefix + "weight."
    for name in [k for k in state_dict if k.startswith(key)]:
        value = state_dict.pop(name)
        field = name[len(key):]
        target = {"absmax": state.absmax, "quant_map": state.code}.get(field)
        if target is not None and isinstance(value, torch.Tensor) and value.shape == target.shape:
            with torch.no_grad():
                target.copy_(value)


def layer_quant_state(module: nn.Module) -> Any:
    """A bitsandbytes 4-bit layer's quantisation state: its weight's, or under FSDP2 (whose DTensor shard carries
    none) the copy the layer keeps, whole on every rank (the fp32 absmax, 1/8 of the packed bytes, is not sharded)."""
    return getattr(module.weight, "quant_state", None) or module.quant_state


def quant_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The quantisation state of ``model``'s 4-bit layers (views of it, where it is), under the names bitsandbytes'
    ``state_dict`` gives it beside the packed weight (``NAME.weight.absmax``, ``.quant_map``,
    ``.quant_state.bitsandbytes__nf4``) of its FSDP2-sharded layers: what a full or sharded state dict lacks, since
    a DTensor shard carries no ``quant_state`` (a layer whose weight carries it writes its own).
    The absmax and code book are the layer's own tensors: a checkpoint's read into them lands in place."""
    entries = {}
    for name, module in model.named_modules():
        if getattr(module, "quant_state", None) is None or getattr(module.weight, "quant_state", None) is not None:
            continue
        for key, value in module.quant_state.as_dict(packed=True).items():
            entries[f"{name}.weight.{key}"] = value.detach()
    return entries


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds 4-bit layers (bitsandbytes' or their meta-device stand-ins)."""
    return any(_is_4bit(m) for m in model.modules())


def _is_4bit(module: nn.Module) -> bool:
    return isinstance(module, Linear4bitStandIn) or getattr(getattr(module, "weight", None), "quant_state",
                                                            None) is not None


def weight_count(model: nn.Module) -> int:
    """The model's parameters counted as weights: a 4-bit layer's stand for in x out weights, whatever its packed
    codes and scales number (the count a plan or a log shows, not the elements stored)."""
    count = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    for m in model.modules():
        if isinstance(m, nn.Linear) and _is_4bit(m):
            stored = sum(p.numel() for p in m.parameters(recurse=False) if p is not m.bias)
            count += m.in_features * m.out_features - stored
    return count


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of the 4-bit weights' quantisation state (absmax, code book) that are not parameters: memory the
    weights hold beside their packed bytes. (A stand-in's are parameters already.)"""
    states = {}  # by identity: PEFT's LoRA layer shows its base layer's weight as its own
    for m in model.modules():
        # The weight's, or under FSDP2 (whose shards carry none) the layer's: layer_quant_state.
        state = getattr(getattr(m, "weight", None), "quant_state", None) or getattr(m, "quant_state", None)
        if state is not None:
            states[id(state)] = state
    return [t for state in states.values() for t in (state.absmax, state.code) if isinstance(t, torch.Tensor)]


def quantized_bytes(numel: int) -> int:
    """The bytes of one layer's ``numel`` weights in NF4: packed codes, fp32 absmax per block, the code book."""
    return (numel + 1) // 2 + 4 * math.ceil(numel / BLOCK_SIZE) + 4 * CODE_ENTRIES


def _dequantized(packed: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` made from the packed codes as the cost model sees bitsandbytes' dequantise
    kernel: one op reading the codes and writing the weight (counted as 1 byte read a weight, bitsandbytes reads half
    a byte and the scales: about 17% more traffic than the kernel's); one allocation of the weight."""
    n, k = shape
    if k % 2:
        return torch.empty(shape, dtype=dtype, device=packed.device)
    pairs = packed.view(n, k // 2, 1).expand(n, k // 2, 2)  # each byte holds two weights' codes
    return pairs.to(dtype).view(n, k)


class _DequantizedMatmul(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` as the meta device sees it: forward dequantises the weight to ``x``'s dtype
    (a transient of out x in elements) and multiplies; backward dequantises it again for the input's gradient.
    Nothing is saved for backward (the packed weight is kept on ``ctx`` as bitsandbytes does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int],
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.shape, ctx.packed = shape, packed
        return nn.functional.linear(x, _dequantized(packed, shape, x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return torch.matmul(grad, _dequantized(ctx.packed, ctx.shape, grad.dtype)), None, None, None


class Linear4bitStandIn(nn.Linear):
    """A bitsandbytes NF4 ``Linear4bit`` for the meta device: its stored bytes (the packed uint8 weight, the fp32
    absmax per block of 64 and the 16-entry code book, as frozen parameters) and its forward's allocations (the
    input cast to the compute dtype, the weight dequantised for the matmul, the output cast back to the input's
    dtype). An ``nn.Linear`` for PEFT, which wraps it as it wraps the real layer; ``clones_output`` mirrors PEFT's
    4-bit LoRA layer, which clones the base output before adding the adapters'."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None,
                 compute_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        numel = in_features * out_features
        frozen = {"requires_grad": False}
        self.weight = nn.Parameter(torch.empty(((numel + 1) // 2, 1), dtype=torch.uint8, device="meta"), **frozen)
        self.absmax = nn.Parameter(torch.empty(math.ceil(numel / BLOCK_SIZE), device="meta"), **frozen)
        self.code = nn.Parameter(torch.empty(CODE_ENTRIES, device="meta"), **frozen)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
        self.clones_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = _DequantizedMatmul.apply(x.to(self.compute_dtype), self.weight, (self.out_features, self.in_features),
                                       bias).to(dtype)
        return out.clone() if self.clones_output else out


def is_quant_state(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s parameter ``name`` is a stand-in's quantisation state (absmax, code book): bitsandbytes
    keeps those in fp32 outside the parameters, so no cast of the weights (bf16 device copies) reaches them."""
    return isinstance(module, Linear4bitStandIn) and name in ("absmax", "code")


def mark_lora_clones(model: nn.Module) -> None:
    """Sets ``clones_output`` on the stand-ins that LoRA adapts (PEFT's 4-bit LoRA layer clones their output)."""
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, Linear4bitStandIn) and hasattr(module, "lora_A"):
            base.clones_output = True


def quant_state_memo(model: nn.Module) -> dict[int, None]:
    """A ``copy.deepcopy`` memo that copies no quantisation state (each 4-bit weight's and layer's ``quant_state``
    become None): what ``meta_model`` passes, so a meta copy of a 4-bit model allocates nothing on its device."""
    memo: dict[int, None] = {}
    for m in model.modules():
        for owner in (m, getattr(m, "weight", None)):
            state = getattr(owner, "quant_state", None)
            if state is not None:
                memo[id(state)] = None
    return memo


def meta_stand_ins(model: nn.Module) -> nn.Module:
    """``model`` (a meta copy) with each bitsandbytes ``Linear4bit`` replaced by a ``Linear4bitStandIn`` of its
    compute dtype, in place; returns it. Without bitsandbytes imported there are none."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return model
    modules = dict(model.named_modules())
    for name, m in modules.items():
        if isinstance(m, bnb.nn.Linear4bit):
            stand_in = Linear4bitStandIn(m.in_features, m.out_features, m.bias, m.compute_dtype or torch.float32)
            parent, _, child = name.rpartition(".")
            setattr(modules[parent] if parent else model, child, stand_in)
    mark_lora_clones(model)
    return model
