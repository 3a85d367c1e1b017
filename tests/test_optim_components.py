"""memtrain's optimizer wrappers are torch optimizers that *have* their parts (landings, host gradients, checkpoint
conversion, the host stepper, step in backward, the host part), not mixins they *are*: each part gets what it needs explicitly, and
none holds its owner (a dropped optimizer is collected at once and stops stepping in backward)."""

from __future__ import annotations

import ast
import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memtrain.device import accelerator
from memtrain.optim import ComposedOptimizer, CPUOffloadOptimizer, build_optimizer
from memtrain.optim.host_buffers import Link, lay_out, make_buckets
from memtrain.optim.host_stepper import HostStepper

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


# Private names of other objects that memtrain/optim may reach, each with why there is no public way.
PRIVATE_NAMES_ALLOWED = {
    "_per_optimizer_states": "GradScaler keeps each optimizer's stage and inf check there; torch has no public API "
                             "to read the stage or hand it an inf check made elsewhere",
    "_scale": "GradScaler's scale as a device tensor; get_scale() returns a Python float (a host sync)",
    "_version": "a tensor's in-place version counter (host_kernels' code-table cache); torch makes it public nowhere",
}
PRIVATE_NAMES_ALLOWED_IN = {
    ("moments.py", "_salts"): "the rounding counter of BF16StateAdamW (same module) and PureBF16AdamW, kept by "
                              "moments.py's helpers that both classes call on themselves (their shared method bodies)",
}


def test_no_part_calls_or_reads_a_private_name_of_another_object() -> None:
    """In memtrain/optim a private name (``x._name``: a method called, an attribute read or written) is reached on
    ``self``/``cls`` only, or on torch itself (its private kernels), or is one of the allowed names above: a part
    reaches another object through what that object makes public."""
    reached = []
    for path in sorted(OPTIM.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            name, owner = node.attr, node.value
            if not name.startswith("_") or name.startswith("__"):
                continue
            root = owner
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls") or isinstance(root, ast.Name) and (
                    root.id == "torch"):
                continue
            if name in PRIVATE_NAMES_ALLOWED or (path.name, name) in PRIVATE_NAMES_ALLOWED_IN:
                continue
            reached.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not reached, f"private names of another object reached: {sorted(set(reached))}"


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


@pytest.fixture
def make_stepper() -> Iterator[Callable[..., tuple[HostStepper, list[dict[str, Any]], list[Any]]]]:
    """Builds HostSteppers over parameters alone (no CPUOffloadOptimizer): the host buffers laid out, the buckets
    built, on the plain CPU's seam (no streams) or ``acc``; their workers are shut down after the test, pass or
    fail."""
    made: list[HostStepper] = []

    def make(params: list[nn.Parameter], hyper: dict[str, Any], *, delayed: bool, bucket_numel: int,
             acc: Any = None) -> tuple[HostStepper, list[dict[str, Any]], list[Any]]:
        cpu = accelerator("cpu")
        groups = [{"params": params, **hyper}]
        slots, order = lay_out(params, groups, None, n_grad_buffers=1, device_dtype=None, acc=cpu)
        in_order = [slots[i] for i in range(len(params))]
        buckets = make_buckets([slots[i] for i in order], in_order, groups, torch.optim.AdamW, {"fused": True},
                               bucket_numel)
        # No side streams, even on a simulated device: the copies back run in order.
        stepper = HostStepper(in_order, buckets, link=Link(acc if acc is not None else cpu, streams=False),
                              delayed=delayed)
        made.append(stepper)
        return stepper, groups, in_order

    yield make
    for stepper in made:
        stepper.worker.shutdown()


def _max_diff(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ours, ref, strict=True))


def test_the_host_stepper_steps_each_bucket_and_copies_it_back_as_torch_adamw_steps(make_stepper) -> None:
    """HostStepper on its own: ``step_bucket`` steps one bucket's masters and copies only its weights back;
    ``run`` steps every bucket with the gradients times the multiplier, follows an lr change
    (``sync_hyperparameters``) and skips on a non-zero inf flag. Parity with torch.optim.AdamW(fused=True) (the same
    CPU kernel) over the same tensors, weights and gradients: tolerance 0 (bit-identical; the masters' 256-byte
    aligned views split the vector loops as separate tensors do)."""
    torch.manual_seed(0)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    params = [nn.Parameter(torch.randn(shape)) for shape in ((7, 5), (5,), (3, 7))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    stepper, groups, slots = make_stepper(params, hyper, delayed=False, bucket_numel=40)
    assert [[s.device.shape for s in b.slots] for b in stepper.buckets] == [
        [(3, 7), (5,)], [(7, 5)]], "reverse registration order, at most 40 elements a bucket (a larger one alone)"
    reference = torch.optim.AdamW(ref, **hyper, fused=True)
    bytes_of = {id(s): s.device.numel() * s.device.element_size() for s in slots}

    # One bucket alone: its weights reach the parameters, the other bucket's stay as they were.
    grads = [torch.randn(p.shape) for p in params]
    for slot, g in zip(slots, grads, strict=True):
        slot.master.grad = g.clone()
    first, second = stepper.buckets
    before = [p.detach().clone() for p in params]
    stepper.step_bucket(first, None, True)
    stepped = {id(s.device) for s in first.slots}
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b) != (id(p) in stepped), "only the stepped bucket's weights change"
    assert stepper.link_bytes["host_to_device"] == sum(bytes_of[id(s)] for s in first.slots)
    stepper.step_bucket(second, None, True)
    for r, g in zip(ref, grads, strict=True):
        r.grad = g.clone()
    reference.step()
    assert _max_diff(params, ref) == 0.0, f"max abs diff {_max_diff(params, ref)} after one step by buckets"

    # run(): every bucket, the multiplier applied as the gradients are read, an lr change followed.
    for step in range(3):
        multiplier = 0.5 if step == 1 else torch.tensor(0.25)
        grads = [torch.randn(p.shape) for p in params]
        for slot, g in zip(slots, grads, strict=True):
            slot.master.grad = g.clone()
        for r, g in zip(ref, grads, strict=True):
            r.grad = g * torch.as_tensor(multiplier, dtype=torch.float64).float()
        if step == 2:
            groups[0]["lr"] = reference.param_groups[0]["lr"] = 5e-3
            stepper.sync_hyperparameters(groups)
        stepper.run(multiplier, None, early={})
        reference.step()
        assert _max_diff(params, ref) == 0.0, f"step {step}: max abs diff {_max_diff(params, ref)}"
        assert all(torch.equal(s.master, s.device) for s in slots), "the device weights are the masters"
    assert stepper.link_bytes["host_to_device"] == 4 * sum(bytes_of.values())

    # A non-zero inf flag: nothing steps, nothing is copied.
    state = {id(p): {k: v.clone() for k, v in reference.state[r].items()} for p, r in zip(params, ref, strict=True)}
    before = [p.detach().clone() for p in params]
    stepper.run(1.0, torch.ones(()), early={})
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)), "a skipped step moved weights"
    assert all(torch.equal(v, state[id(s.device)][k]) for b in stepper.buckets for s in b.slots
               for k, v in b.inner.state[s.master].items()), "a skipped step changed the state"
    assert stepper.link_bytes["host_to_device"] == 4 * sum(bytes_of.values())


def test_a_delayed_host_step_reaches_the_device_at_finish_update(make_stepper) -> None:
    """``delayed``: ``run`` returns with the step in flight and the device weights as they were; ``finish_update``
    waits for it and copies the weights back (tolerance 0 against torch.optim.AdamW(fused=True))."""
    torch.manual_seed(1)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    params = [nn.Parameter(torch.randn(shape)) for shape in ((4, 4), (4,))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    stepper, _, slots = make_stepper(params, hyper, delayed=True, bucket_numel=1 << 20)
    reference = torch.optim.AdamW(ref, **hyper, fused=True)
    before = [p.detach().clone() for p in params]
    grads = [torch.randn(p.shape) for p in params]
    for slot, r, g in zip(slots, ref, grads, strict=True):
        slot.master.grad, r.grad = g.clone(), g.clone()
    stepper.run(1.0, None, early={})
    assert stepper.in_flight is not None, "the step is in flight"
    for future in stepper.in_flight:
        future.result()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)), "copied back before finish_update"
    stepper.finish_update()
    reference.step()
    assert stepper.in_flight is None
    assert _max_diff(params, ref) == 0.0, f"max abs diff {_max_diff(params, ref)}"


class RecordingSeam:
    """The plain CPU's seam, recording the events the worker waits for (``synchronize_event``) instead of waiting."""

    def __init__(self, log: list[tuple[str, Any]]):
        self.cpu, self.log = accelerator("cpu"), log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cpu, name)

    def synchronize_event(self, event: Any) -> None:
        self.log.append(("synchronize_event", event))


def test_each_bucket_waits_for_the_last_copies_back_before_it_steps(make_stepper) -> None:
    """``step_bucket`` overwrites the masters (and casts) that the previous step's copies back may still read: the
    worker waits for their event (``synchronize_event(h2d_done)``) before each bucket's ``inner.step()``."""
    log: list[tuple[str, Any]] = []
    params = [nn.Parameter(torch.randn(shape)) for shape in ((7, 5), (5,), (3, 7))]
    stepper, _, slots = make_stepper(params, dict(lr=1e-2), delayed=False, bucket_numel=40, acc=RecordingSeam(log))
    assert len(stepper.buckets) == 2, "the fixture must give several buckets"
    for index, bucket in enumerate(stepper.buckets):
        def recorded(step=bucket.inner.step, index=index, **kwargs: Any) -> Any:
            log.append(("step", index))
            return step(**kwargs)
        bucket.inner.step = recorded
    for slot in slots:
        slot.master.grad = torch.randn(slot.master.shape)
    h2d_done = object()  # the event after the previous step's copies back
    stepper.h2d_done = h2d_done
    stepper.run(1.0, None, early={})
    waited, steps = False, []
    for what, arg in log:
        if what == "synchronize_event" and arg is h2d_done:
            waited = True
        elif what == "step":
            assert waited, f"bucket {arg} stepped before waiting for the copies back: {log}"
            waited = False
            steps.append(arg)
    assert steps == [0, 1], f"every bucket stepped once, in order: {log}"
