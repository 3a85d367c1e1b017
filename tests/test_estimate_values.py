"""The traced step's kernels and values where fake tensors differ from the real run: grouped_mm in fp32 (MoE
experts) allocates what the real kernel allocates, and a module that reads the value of a tensor computed from
constants takes the real run's branch, its bytes equal to measure's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memtrain import measure
from memtrain.errors import MemtrainError
from memtrain.estimate import estimate
from memtrain.estimate.fake import grouped_mm_output

_OFFS = torch.tensor([24, 64], dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("a_shape, b_shape, transpose", [((64, 32), (2, 32, 48), False), ((32, 64), (64, 48), False),
                                                         ((64, 32), (2, 6, 32), True)])
def test_grouped_mm_output_is_the_real_kernels(a_shape, b_shape, transpose, dtype):
    # (tokens, K) x (experts, K, N): the forward's form, with a transposed weight the output's rows padded to 16
    # bytes; (K, tokens) x (tokens, N): the weight gradient's, one output per expert.
    a, b = torch.randn(a_shape, dtype=dtype), torch.randn(b_shape, dtype=dtype)
    b = b.transpose(-2, -1) if transpose else b
    real = torch._grouped_mm(a, b, offs=_OFFS)
    stand_in = grouped_mm_output(a, b, _OFFS)
    assert (stand_in.shape, stand_in.stride(), stand_in.dtype) == (real.shape, real.stride(), real.dtype)
    assert stand_in.untyped_storage().nbytes() == real.untyped_storage().nbytes()
    with pytest.raises(RuntimeError, match="grouped_mm: expected both inputs"):
        grouped_mm_output(a.double(), b.double(), _OFFS)


class _Experts(nn.Module):
    """Two experts, their tokens grouped by a fixed split, multiplied by grouped_mm in fp32 (as transformers'
    grouped_mm experts run on fp32 weights)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 32, 48) / 8)

    def forward(self, x):
        return torch._grouped_mm(x.reshape(-1, 32), self.weight, offs=_OFFS).square().sum()


def _assert_estimated_as_measured(model, x):
    measured = measure(model, x)
    estimated = estimate(model, x, device="cpu")
    assert estimated.activation_bytes == measured.activation_bytes, (estimated.activation_bytes,
                                                                       measured.activation_bytes)
    assert estimated.gradient_bytes == measured.gradient_bytes


def test_fp32_grouped_mm_is_estimated_as_measured():
    _assert_estimated_as_measured(_Experts(), torch.randn(2, 32, 32))


class _ChecksItsMask(nn.Module):
    """Reads a value computed from constants (an all-ones mask is all ones), as transformers' decoders do before
    passing is_causal=True: the real run takes the cheap branch."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        mask = torch.ones(x.shape[:2], dtype=torch.long)
        h = self.proj(x)
        if bool(mask.sum() == mask.numel()):
            return h.square().sum()
        return (h * torch.randn(x.shape[1], x.shape[1]).softmax(-1)[None, :, :1]).square().sum()  # more saved


def test_a_value_computed_from_constants_takes_the_real_runs_branch():
    model, x = _ChecksItsMask(), torch.randn(4, 16, 16)
    _assert_estimated_as_measured(model, x)
    assert estimate(model, x, device="cuda").activation_bytes > 0  # the meta path reads it too


class _ReadsItsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        kept = int((self.proj.weight > 0).sum()) % 4 + 1  # a value only the data knows
        return self.proj(x)[..., :kept].sum()


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # fake tensors, meta tensors
def test_a_value_computed_from_the_weights_is_named(device):
    with pytest.raises(MemtrainError, match=r"'_ReadsItsWeights' reads a tensor value computed from the batch or "
                                            r"the weights") as caught:
        estimate(_ReadsItsWeights(), torch.randn(4, 16, 16), device=device)
    assert "batch's shape" not in str(caught.value) and "\n" not in str(caught.value)
    assert "To resolve this error, make that module's shapes independent of values, or use memtrain.measure" in \
        str(caught.value)


class _Misaligned(nn.Module):
    """bf16 grouped_mm on rows of 10 bytes: torch's kernels (real and meta) refuse it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 32, 5, dtype=torch.bfloat16))

    def forward(self, x):
        return torch._grouped_mm(x.reshape(-1, 32).bfloat16(), self.weight, offs=_OFFS).float().sum()


def test_a_meta_kernel_that_fails_is_one_line_not_a_logged_traceback(caplog):
    with pytest.raises(MemtrainError, match="'_Misaligned'.*16 bytes"):
        estimate(_Misaligned(), torch.randn(2, 32, 32), device="cpu")
    logged = [r.getMessage() for r in caplog.records]
    assert not any("failed while attempting to run meta" in m for m in logged), logged
