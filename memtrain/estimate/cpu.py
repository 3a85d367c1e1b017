"""What the CPU's kernels allocate inside themselves, which their outputs do not show: the estimate counts it as a
transient beside the outputs (``LiveTracker.transient``).

The CPU's flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, torch 2.11 to 2.14) splits the
queries into blocks of 32, 64 or 256 rows (by the query length: under 192, under 768, longer) and the keys into
blocks of 512, and gives each thread a scratch buffer of accumulation-type (fp32 for fp32, bf16 and fp16 inputs)
blocks: forward, the scores (q x kv), their row maxima and sums and the output rows (q x head dim); backward, the
scores and their gradient (2 x q x kv) and a row sum (q), and for 16-bit inputs a copy of the blocks in the input
dtype. Backward also copies the output's gradient to the kernel's layout (batch, length, heads, dim) where it is not
already in it. At 8,192 tokens on 2 threads backward's scratch is 2 MiB, which set a tiled-MLP GPT block's peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _splits(q_len: int, kv_len: int) -> tuple[int, int]:
    """The kernel's query and key block sizes, each at most the length."""
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _accumulate_bytes(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4


def kernel_scratch_bytes(func: Any, args: Sequence[Any], threads: int) -> int:
    """The bytes ``func`` (an aten overload called with ``args``) allocates and frees inside itself on the CPU with
    ``threads`` threads, beside its outputs; 0 for an op this does not know."""
    name = func.overloadpacket.__name__
    if name not in (_FORWARD, _BACKWARD):
        return 0
    query, key = (args[0], args[1]) if name == _FORWARD else (args[1], args[2])  # (batch, heads, length, dim)
    q_split, kv_split = _splits(query.shape[-2], key.shape[-2])
    accumulate, reduced = _accumulate_bytes(query.dtype), query.dtype in (torch.bfloat16, torch.float16)
    element = query.element_size()
    if name == _FORWARD:
        per_thread = (q_split * kv_split + 2 * q_split + q_split * query.shape[-1]) * accumulate
        per_thread += q_split * kv_split * element if reduced else 0
        return threads * per_thread
    grad_out = args[0].transpose(1, 2)
    copy = 0 if grad_out.is_contiguous() else grad_out.numel() * grad_out.element_size()
    per_thread = 2 * q_split * kv_split * accumulate + q_split * accumulate  # scores, their gradient, a row sum
    per_thread += 2 * q_split * kv_split * element if reduced else 0
    return copy + threads * per_thread
