"""Selective checkpointing: what it keeps, that ops drawing random numbers are always recomputed, and
that the meter counts what it keeps."""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path

import pytest
import torch
from checkpointing_parity import assert_grads_equal, gpt, gpt_step, run_twice
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain import (
    apply_checkpointing,
    measure,
)


def test_selective_keeps_more_than_full_and_less_than_none():
    model = gpt(dropout=0.0)
    _, _, plain, selective = run_twice(model, gpt_step, selective=("matmul", "attention"))
    _, _, _, full = run_twice(gpt(dropout=0.0), gpt_step)
    assert full.activation_bytes < selective.activation_bytes < plain.activation_bytes



_ATTENTION_WITH_DROPOUT = {
    # What the CUDA path dispatches (CPU SDPA with dropout falls back to ordinary, recomputed ops): each fused
    # kernel with dropout_p > 0 consumes Philox offsets, and returns the seed and offset it used.
    "flash": (torch.ops.aten._scaled_dot_product_flash_attention.default, lambda q, p: (q, q, q, p), {}),
    "efficient": (torch.ops.aten._scaled_dot_product_efficient_attention.default,
                  lambda q, p: (q, q, q, None, True, p), {}),
    "cudnn": (torch.ops.aten._scaled_dot_product_cudnn_attention.default, lambda q, p: (q, q, q, None, True, p), {}),
    "efficient, dropout_p by keyword": (torch.ops.aten._scaled_dot_product_efficient_attention.default,
                                        lambda q, p: (q, q, q, None, True), "dropout_p"),
}



@pytest.mark.parametrize("kernel", list(_ATTENTION_WITH_DROPOUT))
def test_selective_policy_recomputes_fused_attention_with_dropout_and_keeps_it_without(kernel):
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from memtrain.checkpointing.selective import keep_policy, op_packets

    op, positional, keyword = _ATTENTION_WITH_DROPOUT[kernel]
    ops = op_packets(("matmul", "attention"))
    q = torch.empty(1, 2, 8, 4, device="meta")

    def policy(p: float) -> CheckpointPolicy:
        args, kwargs = (positional(q, p), {}) if not keyword else (positional(q, p), {keyword: p})
        return keep_policy(ops, SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs)

    assert policy(0.1) == CheckpointPolicy.MUST_RECOMPUTE, f"{op} with dropout_p=0.1 would skip its Philox draws"
    assert policy(0.0) == CheckpointPolicy.MUST_SAVE, f"{op} without dropout is the FLOPs worth keeping"



@pytest.mark.parametrize("op", [torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli_.float,
                                torch.ops.aten.rand_like.default], ids=str)
def test_selective_policy_recomputes_every_op_that_draws_random_numbers(op):
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from memtrain.checkpointing.selective import keep_policy, op_packets

    ops = op_packets(("matmul", "attention", "conv")) | {op.overloadpacket}  # even when asked to keep it
    x = torch.empty(4, 4, device="meta")
    args = (x, 0.1, True) if op is torch.ops.aten.native_dropout.default else (x, 0.5) if "bernoulli" in str(op) \
        else (x,)
    assert keep_policy(ops, SelectiveCheckpointContext(is_recompute=False), op, *args) in (
        CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)



_noisy_library = torch.library.Library("memtrain_test", "FRAGMENT")
_noisy_library.define("noisy_mm(Tensor x, Tensor w, float dropout_p) -> (Tensor, Tensor)",
                      tags=(torch.Tag.nondeterministic_seeded,))



@torch.library.impl(_noisy_library, "noisy_mm", "CPU")
def _noisy_mm(x: torch.Tensor, w: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    # A fused "matmul + dropout" kernel: it draws its mask from the generator inside, as flash attention does.
    mask = torch.empty_like(x @ w).bernoulli_(1 - dropout_p) / (1 - dropout_p)
    return (x @ w) * mask, mask



class _NoisyMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, dropout_p):
        out, mask = torch.ops.memtrain_test.noisy_mm(x, w, dropout_p)
        ctx.save_for_backward(x, w, mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, mask = ctx.saved_tensors
        g = grad * mask
        return g @ w.t(), x.t() @ g, None



class _NoisyBlock(nn.Module):
    """A kept kernel that draws random numbers, followed by an ordinary dropout."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = _NoisyMM.apply(torch.tanh(x), self.w, 0.3)
        return x + self.lin(torch.ops.aten.native_dropout(torch.tanh(y), 0.3, True)[0])



def test_a_kept_op_that_draws_random_numbers_is_recomputed_and_gradients_equal_plain_training_bitwise():
    """On CUDA a kept fused attention kernel with dropout is such an op: saved, it would not draw again in the
    recompute, and the dropout after it would get another mask. Here a CPU kernel of that kind stands in for it."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from memtrain.checkpointing.selective import keep_policy

    torch.manual_seed(0)
    plain = nn.Sequential(*[_NoisyBlock() for _ in range(3)])
    wrapped = copy.deepcopy(plain)
    keep = frozenset({torch.ops.memtrain_test.noisy_mm, torch.ops.aten.mm})
    context_fn = functools.partial(create_selective_checkpoint_contexts, functools.partial(keep_policy, keep))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    plain(x).square().sum().backward()
    torch.manual_seed(5)
    h = x
    for block in wrapped:
        h = checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
    h.square().sum().backward()
    assert_grads_equal(plain, wrapped)



def test_the_meter_counts_what_selective_checkpointing_keeps_on_torch_without_op_output(monkeypatch):
    """torch 2.11's SelectiveCheckpointContext has no op_output (its policy runs before the op): the kept matmul
    and attention outputs must still be counted, by the bytes they hold."""
    import torch.utils.checkpoint as torch_checkpoint

    def step(model):
        return measure(lambda: gpt_step(model), model=model).activation_bytes

    def kept_output_bytes(model) -> int:
        """Bytes of the matmul and attention outputs inside the blocks of a plain forward (each storage once)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        from memtrain.checkpointing.selective import op_packets

        ops, inside, seen = op_packets(("matmul", "attention")), [False], {}

        class Outputs(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if inside[0] and func.overloadpacket in ops:
                    for t in torch.utils._pytree.tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            seen[t.untyped_storage()._cdata] = t  # held: a freed storage's address is reused
                return out

        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
        with Outputs():
            gpt_step(model)
        return sum(t.untyped_storage().nbytes() for t in seen.values())

    full = gpt(dropout=0.0)
    apply_checkpointing(full)
    expected = step(full) + kept_output_bytes(gpt(dropout=0.0))

    class ContextOfTorch211:
        def __init__(self, *, is_recompute, op_output=None):
            self.is_recompute = is_recompute

    monkeypatch.setattr(torch_checkpoint, "SelectiveCheckpointContext", ContextOfTorch211)
    selective = gpt(dropout=0.0)
    apply_checkpointing(selective, selective=("matmul", "attention"))
    got = step(selective)
    assert got == expected, f"selective checkpointing measured {got / 2**20:.2f} MiB, expected {expected / 2**20:.2f} MiB"


@pytest.mark.skipif("respect_saved_tensors_hooks" not in inspect.signature(checkpoint).parameters,
                    reason="this torch's checkpoint routes no selective region's kept outputs through the hooks "
                           "(torch < 2.14.1), and asks nothing")
def test_selective_checkpointing_under_a_saved_tensors_hook_keeps_its_outputs_and_does_not_warn():
    """torch >= 2.14.1 warns (a FutureWarning, once a process: hence a process of its own) where a selective region
    runs inside saved-tensor hooks (memtrain's meter and activation offloader) and its checkpoint is not told where
    the kept outputs go; memtrain tells it (respect_saved_tensors_hooks=False: they stay in checkpoint's cache)."""
    import subprocess
    import sys

    code = "\n".join([
        "import torch",
        "from memtrain.checkpointing import Checkpointing",
        "from memtrain.models import GPT, GPTConfig",
        "model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, dropout=0.0))",
        "Checkpointing.parse('selective').apply(model)",
        "x = torch.randint(0, 256, (2, 16))",
        "with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):",
        "    loss = model(x, x)",
        "loss.backward()",
    ])
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
