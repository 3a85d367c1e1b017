"""Tests of memtrain.planner: the traced profiles: identical blocks traced three at a time."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import h100, planner_llama

transformers = pytest.importorskip("transformers")

H100 = h100()



def test_identical_blocks_are_traced_three_at_a_time():
    """Profiles from a copy holding the first five blocks and the last equal those of the whole model."""
    from memtrain.planner.cost import Composer
    from memtrain.planner.search import problem_of
    from memtrain.planner.settings import Configuration
    from memtrain.planner.tracing import build_profiles, profiles_from_traces, truncated_copy

    ctx = problem_of(planner_llama(layers=9), 1024, 2, "cuda", "bf16-mixed", 1, True, True, H100)
    truncated = truncated_copy(ctx.model, ctx.block_names)
    assert truncated is not None and truncated[1] == [0, 1, 2, 3, 4, 4, 4, 4, 5]
    whole = Composer(ctx, {None: profiles_from_traces(ctx, ["full", "offload-inputs"], True, None, None)})
    four = Composer(ctx, {None: build_profiles(ctx, ["full", "offload-inputs"], True, None)})
    for b in (1, 2):
        for chunked in (False, True):
            for flavor in ("full", "offload-inputs"):
                cfg = Configuration(micro_batch_size=b, accumulation=2 // b, flavor=flavor, chunked_loss=chunked,
                                    optimizer="device", distribution="none", compile=False, precision="bf16-mixed")
                for offload in (0, 3):
                    r = np.arange(10 - offload)
                    a, c = whole.rows(cfg, offload, r), four.rows(cfg, offload, r)
                    assert np.allclose(a[0], c[0]), (b, chunked, flavor, offload, a[0] - c[0])
                    assert np.allclose(a[2], c[2], rtol=1e-9), (b, chunked, flavor, offload, a[2] / c[2])


def test_parameters_without_gradients_have_no_state_in_the_plan():
    """A block whose second Linear is never called, nine of them (profiled from a truncated copy), and a spare head:
    the composed peak is the full estimate's, which counts no gradient or state for the unused parameters."""
    import torch
    from torch import nn

    from memtrain.estimate import estimate
    from memtrain.planner import plan, predictions

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, h):
            return self.used(h).relu()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head, self.spare = nn.Embedding(256, 64), nn.Linear(64, 256), nn.Linear(64, 64)
            self.layers = nn.ModuleList(Block() for _ in range(9))

        def forward(self, x):
            h = self.emb(x)
            for block in self.layers:
                h = block(h)
            return self.head(h)

    torch.manual_seed(0)
    model = Model()
    unused = sum(p.numel() * 4 for name, p in model.named_parameters() if "unused" in name or "spare" in name)
    full = estimate(model, (4, 32), device="cpu")
    used = full.parameter_bytes - unused
    assert full.gradient_bytes == used and full.optimizer_state_bytes == 2 * used + 4 * 21, full  # 21 used tensors
    p = plan(model, budget=None, seq_len=32, global_batch_size=4, device="cpu", precision="fp32",
             micro_batch_size=4)
    (composed,) = predictions(model, [p.settings], seq_len=32, global_batch_size=4, device="cpu")
    assert p.peak_bytes == composed.peak_bytes == full.peak_bytes, (p.peak_bytes, composed.peak_bytes, full.peak_bytes)
