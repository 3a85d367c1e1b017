"""memtrain's optimizer wrappers are torch optimizers that *have* their parts (landings, host gradients, checkpoint
conversion, step in backward, the host part), not mixins they *are*: each part gets what it needs explicitly, and
none holds its owner (a dropped optimizer is collected at once and stops stepping in backward)."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import torch
from torch import nn

from memtrain.optim import ComposedOptimizer, CPUOffloadOptimizer, build_optimizer

OPTIM = Path(__file__).resolve().parents[1] / "memtrain" / "optim"


def test_the_wrappers_subclass_only_torchs_optimizer() -> None:
    assert CPUOffloadOptimizer.__bases__ == (torch.optim.Optimizer,), CPUOffloadOptimizer.__bases__
    assert ComposedOptimizer.__bases__ == (torch.optim.Optimizer,), ComposedOptimizer.__bases__


def test_no_part_declares_its_owners_attributes() -> None:
    """No ``if TYPE_CHECKING:`` block in memtrain/optim declares attributes or methods (what a mixin needs of the
    class it is mixed into)."""
    declared = []
    for path in sorted(OPTIM.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                declared += [f"{path.name}:{s.lineno}" for s in node.body
                             if isinstance(s, ast.AnnAssign | ast.FunctionDef)]
    assert not declared, f"declarations of a host's attributes under TYPE_CHECKING: {declared}"


def test_a_dropped_step_in_backward_optimizer_is_collected_and_stops_stepping() -> None:
    """The backward hooks hold the step-in-backward part weakly and the parts hold no reference to the optimizer:
    once the last reference goes (no cycle collection needed), backward leaves the gradients where it puts them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    for fraction in (0.0, 0.5):
        opt = build_optimizer(model.named_parameters(), lr=0.1, step_in_backward=True, offload_fraction=fraction)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        alive = weakref.ref(opt)
        enabled = gc.isenabled()
        gc.disable()
        try:
            del opt
            assert alive() is None, f"offload_fraction={fraction}: the optimizer outlived its last reference"
        finally:
            if enabled:
                gc.enable()
        gc.collect()  # the host part's own threads and buffers
        before = [p.detach().clone() for p in model.parameters()]
        model(x).sum().backward()
        device = [p for p in model.parameters() if p.grad is not None]
        assert device, f"offload_fraction={fraction}: no gradient was left on the parameters"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), (
            f"offload_fraction={fraction}: a dropped optimizer stepped in backward")
        model.zero_grad(set_to_none=True)
