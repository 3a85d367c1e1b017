"""CUDA's rules where they change memory, applied on the CPU's kernels: the caching allocator's 512-byte blocks and
cuBLAS workspaces, the CUDA autocast op lists (e.g. ``pow`` and ``layer_norm`` run in fp32), CUDA's fused dropout,
and the attention kernel ``scaled_dot_product_attention`` picks on sm90 (flash, memory-efficient, or the math
fallback that materialises the attention matrix), with a stand-in for the fused kernels' memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from memtrain.estimate.tracker import LiveTracker, attention_flops

# -- the caching allocator ------------------------------------------------------------------------------------
# The CUDA caching allocator hands out blocks in multiples of 512 bytes; memory_allocated counts blocks.
CUDA_BLOCK = 512
# cuBLAS keeps one workspace per (handle, stream); forward (main thread) and backward (autograd's device thread)
# use different handles. 32 MiB each on Hopper (torch's default for sm90), allocated by the caching allocator.
CUDA_WORKSPACE_BYTES = 2 * 32 * 2**20


# -- CUDA rules on the CPU's kernels -------------------------------------------------------------------------
# torch's CUDA autocast policy (aten/src/ATen/autocast_mode.cpp), by Python function name.
_LOWER_PRECISION = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
})
_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "cross_entropy",
    "rms_norm",
})
# Ops whose output dtype autocast sets to fp32 (when the caller gave none): fp32 output from a bf16 input.
_FP32_OUTPUT = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum", "linalg_vector_norm"})
_LOW = (torch.float16, torch.bfloat16)


class CudaRules(TorchFunctionMode):
    """CUDA autocast (when ``dtype`` is set) and CUDA's choice of attention kernel, on the CPU's kernels."""

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype = dtype
        self.autocast = False  # on during forward and during a checkpointed block's recompute (grad enabled)
        self.cache: dict[int, torch.Tensor] | None = None  # autocast's cast cache: leaf weights, until forward ends
        self.tracker: LiveTracker | None = None  # told the work of the attention kernels emulated here

    def around_recompute(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wraps a checkpointed block's function so that its recompute in backward runs under these rules too.

        ``loss.backward()`` goes through this mode's ``__torch_function__``, which takes the mode off the stack while
        it runs, so the recompute would otherwise see the CPU's rules (and fail checkpoint's dtype check).
        """

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if self in torch.overrides._get_current_function_mode_stack():
                return fn(*args, **kwargs)
            with self:
                return fn(*args, **kwargs)

        return run

    def _cast(self, x: Any, dtype: torch.dtype, cacheable: bool) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
                and x.dtype != dtype):
            return x
        if cacheable and self.cache is not None and x.is_leaf and x.requires_grad and x.dtype == torch.float32:
            cached = self.cache.get(id(x))
            if cached is None:
                cached = self.cache[id(x)] = x.to(dtype)
            return cached
        return x.to(dtype)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if self.dtype is not None and self.autocast and torch.is_grad_enabled():
            if name in _LOWER_PRECISION:
                args, kwargs = tree_map(lambda x: self._cast(x, self.dtype, True), (args, kwargs))
            elif name in _FP32:
                args, kwargs = tree_map(lambda x: self._cast(x, torch.float32, False), (args, kwargs))
            elif name in _FP32_OUTPUT and kwargs.get("dtype") is None and any(
                isinstance(x, torch.Tensor) and x.dtype in _LOW for x in tree_leaves(args)
            ):
                kwargs["dtype"] = torch.float32
        if name == "scaled_dot_product_attention":
            return _cuda_sdpa(*args, tracker=self.tracker, **kwargs)
        if name == "dropout":
            return _cuda_dropout(*args, **kwargs)

        return func(*args, **kwargs)


def _cuda_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """CUDA's dropout is the fused ``native_dropout``: it saves a 1-byte mask, where the CPU's saves a mask in the
    input's dtype."""
    if not training or p == 0.0 or inplace or not torch.is_grad_enabled():
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _cuda_sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, is_causal: bool,
                      enable_gqa: bool) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` picks on an sm90 GPU (flash, efficient, or math)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "math"
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    d, dv = q.shape[-1], v.shape[-1]
    same_heads = hq == hk == hv
    gqa = enable_gqa and hk == hv and hq % hk == 0
    if (q.dtype in _LOW and attn_mask is None and d == dv == k.shape[-1] and d <= 256
            and (same_heads or gqa) and not (is_causal and q.shape[-2] != k.shape[-2])):
        return "flash"
    # Memory-efficient attention supports fp32 and masks, but not grouped-query attention.
    alignment = 8 if q.dtype in _LOW else 4
    if same_heads and d % alignment == 0 and dv % alignment == 0:
        return "efficient"
    return "math"


def _cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, tracker: LiveTracker | None = None) -> torch.Tensor:
    kernel = _cuda_sdpa_kernel(query, key, value, attn_mask, is_causal, enable_gqa)
    if kernel == "math":
        dtype = query.dtype
        if dtype in _LOW:  # on CUDA the math kernel computes half-precision inputs in fp32
            query, key, value = query.float(), key.float(), value.float()
        out = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
        return out.to(dtype)
    flops = attention_flops(query, key, is_causal)
    if tracker is not None:
        tracker.add_attention_flops(flops)
    return _FusedAttention.apply(query, key, value, kernel, tracker, flops)


class _FusedAttention(torch.autograd.Function):
    """The memory of CUDA's flash / memory-efficient attention: what they allocate, save and free (no math)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str,
                tracker: LiveTracker | None = None, flops: float = 0.0) -> torch.Tensor:
        ctx.tracker, ctx.flops = tracker, flops
        b, h, t, _ = q.shape
        # Both kernels write the output as (B, T, H, D) and return a transposed view: the usual
        # `out.transpose(1, 2).contiguous()` that follows costs nothing.
        out = q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)
        lse_len = t if kernel == "flash" else -(-t // 32) * 32
        lse = q.new_empty((b, h, lse_len), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        b, h, t, d = q.shape
        tk, hk = k.shape[2], k.shape[1]
        workspace = []
        if ctx.kernel == "flash":  # FlashAttention-2: softmax_d and an fp32 dq accumulator, rounded up
            t_round = -(-t // 128) * 128
            d_round = -(-d // (32 if d <= 128 else 64)) * (32 if d <= 128 else 64)
            workspace.append(q.new_empty((b, h, t_round), dtype=torch.float32))
            workspace.append(q.new_empty((b, t_round, h, d_round), dtype=torch.float32))
        else:
            workspace.append(q.new_empty((b, h, t), dtype=torch.float32))
            if q.dtype != torch.float32:
                workspace.append(q.new_empty((b, t, h, d), dtype=torch.float32))
        dq = q.new_empty((b, t, h, d)).transpose(1, 2)
        if hk != h:  # grouped-query: gradients per query head first, then summed into the key/value heads
            workspace.append(k.new_empty((b, tk, h, k.shape[-1])))
            workspace.append(v.new_empty((b, tk, h, v.shape[-1])))
        dk = k.new_empty((b, tk, hk, k.shape[-1])).transpose(1, 2)
        dv = v.new_empty((b, tk, hk, v.shape[-1])).transpose(1, 2)
        del workspace
        if ctx.tracker is not None:
            ctx.tracker.add_attention_flops(2.5 * ctx.flops)  # five matmuls against the forward's two
        return dq, dk, dv, None, None, None
