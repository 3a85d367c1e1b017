"""Two constraints of ``apply_plan``'s stage order (``memtrain.planner.apply.STAGES``), each run with the order
swapped:

- ``torch.compile`` after DDP: compiled first, the DDP wrapper (built over the model, not over the compiled module)
  replaces the compiled module, and the loop calls an uncompiled DDP module. Run in a 2-rank fake process group
  (``torch.testing._internal.distributed.fake_pg``: one process, collectives that do nothing), since a 1-rank group
  is refused for a DDP plan.
- the placement before parameter offload: the placement leaves the streamed blocks' weights in host memory by its
  own list (``streamed_params``), so with that list the swapped order trains bit-identically; the order matters
  where the placement does not know them (the fault below): placed after the streamer, it puts the optimizer's host
  weights, which the blocks read at rest, on the device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_gpt
from torch import nn

from memtrain.device import simulate
from memtrain.planner import PlanSettings, apply_plan
from memtrain.planner import apply as applying
from memtrain.planner.apply import STAGES, Stage

# torch's internal testing package (the fake process group) warns of torch.jit.script_method as it loads.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _settings(**overrides) -> PlanSettings:
    fields = dict(micro_batch_size=2, accumulation=1, blocks=("recompute",) * 4, flavor="full", chunked_loss=False,
                  optimizer="device", distribution="none", compile=False, precision="bf16-mixed")
    return PlanSettings(**{**fields, **overrides})


def _moved(name: str, *, before: str) -> tuple[Stage, ...]:
    """``STAGES`` with the stage ``name`` moved to just before the stage ``before`` (a wrong order)."""
    stages = [s for s in STAGES if s.run.__name__ != name]
    at = next(i for i, s in enumerate(stages) if s.run.__name__ == before)
    return (*stages[:at], next(s for s in STAGES if s.run.__name__ == name), *stages[at:])


# -- torch.compile after DDP ----------------------------------------------------------------------------------------
@pytest.fixture
def two_ranks():
    """A fake 2-rank process group in this process (DDP's collectives return at once), destroyed after the test."""
    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    assert not dist.is_initialized(), "a process group left initialised by an earlier test"
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _compiled_ddp(monkeypatch, stages: tuple[Stage, ...]) -> tuple[nn.Module, nn.Module, nn.Module]:
    """A DDP plan with compile applied by ``stages``: the model, the module the loop calls and the accumulator's."""
    monkeypatch.setattr(applying, "STAGES", stages)
    model = tiny_gpt(4, seed=0)
    run = apply_plan(model, _settings(distribution="ddp", compile=True), lr=1e-3)
    return model, run.train_model, run.accumulator.model


def test_compile_after_ddp_compiles_the_ddp_module_the_loop_calls(monkeypatch, two_ranks):
    model, train_model, called = _compiled_ddp(monkeypatch, STAGES)
    assert isinstance(train_model, torch._dynamo.eval_frame.OptimizedModule), type(train_model)
    ddp = train_model._orig_mod
    assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is model, type(ddp)
    assert called is train_model, f"the accumulator calls {type(called).__name__}, not the compiled module"


def test_compile_before_ddp_leaves_the_loop_an_uncompiled_ddp_module(monkeypatch, two_ranks):
    """Fault injection for the check above: compiled first, the compiled module is dropped (DDP wraps the model
    itself), and the loop calls a DDP module with nothing compiled in it (whole-model compile; a model whose blocks
    offload activations is compiled per block, in place, and would keep them)."""
    model, train_model, called = _compiled_ddp(monkeypatch, _moved("torch_compile", before="data_parallelism"))
    assert isinstance(train_model, nn.parallel.DistributedDataParallel) and train_model.module is model, (
        type(train_model))
    compiled = [n for n, m in train_model.named_modules()
                if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)]
    assert not compiled, f"compiled modules in the loop's module: {compiled}"
    assert called is train_model


# -- the placement before parameter offload ---------------------------------------------------------------------
def _streamed_run(monkeypatch, stages: tuple[Stage, ...]) -> dict:
    """Parameter offload applied on a simulated device by ``stages``, then two steps: the block weights the device
    holds after apply_plan, whether each reads the optimizer's host weights at rest, the device bytes held, and
    the weights after the steps."""
    monkeypatch.setattr(applying, "STAGES", stages)
    model = tiny_gpt(4, seed=0)
    blocks = [p for b in model.blocks for p in b.parameters()]
    with simulate("8MiB") as acc:
        run = apply_plan(model, _settings(optimizer="offload", offload_weights=True), lr=1e-2)
        try:
            hosts = {id(s.device): s.master if s.cast is None else s.cast for s in run.optimizer.slots}
            out = {"on_device": sum(acc.holds(p) for p in blocks), "block_weights": len(blocks),
                   "reads_host_weights": all(p.data_ptr() == hosts[id(p)].data_ptr() for p in blocks),
                   "held": acc.memory_allocated(),
                   "rest": sum(p.numel() * p.element_size() for p in model.parameters()) - sum(
                       p.numel() * p.element_size() for p in blocks)}
            x = torch.randint(0, 64, (2, 16))
            for _ in range(2):
                with run.accumulator.micro_batch(is_last=True):
                    run.accumulator.backward(model(x, x), reduction="mean", items=1)
                run.accumulator.step()
            out["weights"] = [p.detach().clone() for p in model.parameters()]
        finally:
            run.optimizer.close()
    return out


def test_parameter_offload_after_the_placement_streams_the_blocks_from_the_host_weights(monkeypatch):
    got = _streamed_run(monkeypatch, STAGES)
    assert got["on_device"] == 0 and got["reads_host_weights"], got
    assert got["rest"] <= got["held"] < got["rest"] + 4096, (
        f"device holds {got['held']} B, the weights outside the blocks {got['rest']} B (plus buffers)")


def test_parameter_offload_before_the_placement_trains_alike_while_the_placement_leaves_the_streamed_weights(
        monkeypatch):
    """The swapped order breaks nothing today: the placement leaves the streamed weights by its own list, whatever
    ran first (the order in STAGES is a second guard). Same device bytes, same weights after two steps."""
    real = _streamed_run(monkeypatch, STAGES)
    swapped = _streamed_run(monkeypatch, _moved("parameter_offload", before="placement"))
    assert swapped["on_device"] == 0 and swapped["reads_host_weights"] and swapped["held"] == real["held"], swapped
    diff = max((a - b).abs().max().item() for a, b in zip(real["weights"], swapped["weights"], strict=True))
    assert diff == 0.0, f"max abs diff {diff:.3e} between the orders after two steps"


def test_a_placement_unaware_of_streaming_after_parameter_offload_puts_the_host_weights_on_the_device(monkeypatch):
    """Fault injection: the placement without its list of streamed weights. In the real order the streamer then
    takes the blocks' weights off the device again (nothing held at rest); placed after it, the optimizer's host
    weights that the blocks read at rest are counted on the device: the whole model held, as if not streamed."""
    monkeypatch.setattr(applying, "streamed_params", lambda model, blocks: [])
    real = _streamed_run(monkeypatch, STAGES)
    assert real["on_device"] == 0 and real["reads_host_weights"], real
    swapped = _streamed_run(monkeypatch, _moved("parameter_offload", before="placement"))
    blocks = sum(p.numel() for b in tiny_gpt(4, seed=0).blocks for p in b.parameters())
    assert swapped["on_device"] == swapped["block_weights"] and swapped["held"] >= real["held"] + 4 * blocks, (
        f"block weights on the device {swapped['on_device']}, held {swapped['held']} B, real order {real['held']} B, "
        f"the blocks' fp32 bytes {4 * blocks}")
