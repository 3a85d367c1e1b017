"""memtrain with torch.compile: a compiled model keeps every technique's results (docs/design.md, "H200
anchors": "memtrain must compose with it").

The compiled graphs come from AOTAutograd with the ``aot_eager`` backend: the same forward/backward split,
saved tensors and hooks as inductor, without code generation, so each test takes seconds on a CPU. Checkpointing
with a chunked loss under compile is in tests/test_loss.py.
"""

from __future__ import annotations

import pytest
import torch

from memtrain import CPUOffloadOptimizer, apply_checkpointing
from memtrain.loss import apply_chunked_loss
from memtrain.measure import CompileCounts, compile_counts
from memtrain.models import GPT, GPTConfig
from memtrain.offload import ActivationOffloader, CpuTransport

TOL = dict(rtol=1e-6, atol=1e-7)  # fp32 on CPU; aot_eager runs the same kernels as eager


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32))


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(seed))


def test_activation_offload_sees_and_restores_a_compiled_graphs_saved_tensors():
    x = _batch(0)
    eager = _gpt()
    eager(x, x).backward()
    offloader = ActivationOffloader(CpuTransport(), min_bytes=1, host_budget_bytes=2**24, slab_bytes=2**16)
    model = _gpt()
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):  # the second step reuses the pool and the recorded order
        model.zero_grad(set_to_none=True)
        with offloader:
            loss = compiled(x, x)
        loss.backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    stats = offloader.stats()
    # The compiled graph saves its activations through autograd as eager does: the offloader moved them.
    assert stats.offloaded_tensors > 10 and stats.offloaded_bytes > 0 and stats.host_used_bytes == 0, stats


def test_cpu_offload_optimizer_steps_a_compiled_model_as_adamw_steps_the_eager_one():
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    eager, model = _gpt(), _gpt()
    apply_checkpointing(model)
    compiled = torch.compile(model, backend="aot_eager")
    reference = torch.optim.AdamW(eager.parameters(), fused=True, **hyper)  # the kernel the offloader runs
    offloaded = CPUOffloadOptimizer(model.named_parameters(), **hyper)
    for step in range(5):
        x = _batch(step)
        eager(x, x).backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        reference.step()
        reference.zero_grad(set_to_none=True)
        compiled(x, x).backward()  # the gradients land on the host through the parameters' hooks
        offloaded.clip_grad_norm_(0.5)
        offloaded.step()
        offloaded.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=name)
    offloaded.close()


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_checkpointing_and_a_chunked_loss_compile_into_one_graph(kind):
    """No graph break: a break inside a checkpointed block makes dynamo run the whole forward eagerly (a loop
    with a break is skipped), so compiled + memtrain would quietly be eager + memtrain."""
    from torch._dynamo.utils import counters

    if kind == "gpt":
        model = _gpt()
    else:
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          max_position_embeddings=64)
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config)
    apply_checkpointing(model)
    apply_chunked_loss(model, chunk_tokens=16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    x = _batch(0)
    (compiled(x, x) if kind == "gpt" else compiled(x, labels=x).loss).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_selective_checkpointing_compiles_and_keeps_the_gradients():
    """A selective policy reaches torch.compile as the one context_fn form it traces: same gradients, one graph."""
    from torch._dynamo.utils import counters

    x = _batch(1)
    eager = _gpt()
    eager(x, x).backward()
    model = _gpt()
    apply_checkpointing(model, selective=("matmul", "attention"))
    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend="aot_eager")(x, x).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_batchnorm_blocks_compile_and_update_their_statistics_once():
    """Under compile the running statistics need no snapshot (the graph updates them once, in forward): no graph
    break, and the buffers equal eager checkpointing's."""
    from torch._dynamo.utils import counters

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16),
                                                         torch.nn.ReLU()) for _ in range(3)])

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    eager, compiled_model = model(), model()
    apply_checkpointing(eager, blocks=["0", "1", "2"])
    apply_checkpointing(compiled_model, blocks=["0", "1", "2"])
    eager(x).sum().backward()
    torch._dynamo.reset()
    counters.clear()
    torch.compile(compiled_model, backend="aot_eager")(x).sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    for (name, a), b in zip(compiled_model.state_dict().items(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)  # num_batches_tracked == 1 in both
    for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


# -- activation offload under compile, and graph breaks in every set-up the planner chooses ------------------
def _cpu_offloader() -> ActivationOffloader:
    """An enabled offloader on the CPU: the hooks, pool and prefetch of the CUDA path, with plain copies."""
    return ActivationOffloader(CpuTransport(), min_bytes=1, host_budget_bytes=2**24, slab_bytes=2**16)


# What the planner can choose for the blocks (apply_plan spells each as one of these), on a 3-block GPT.
SET_UPS = ("none", "all", "every:2", "selective", "all+offload", "selective+offload", "blocks(ORK)",
           "blocks(ORK)+offload")


def graph_break_counts(set_up: str, chunked_loss: bool, *, backend: str = "aot_eager") -> CompileCounts:
    """Graphs and graph breaks of one training step of a 3-block GPT checkpointed as ``set_up`` (a
    ``Checkpointing`` spelling; offloaded activations through an enabled CPU offloader), compiled as
    ``apply_plan`` compiles it (``compile_model``). A plain GPT compiles with 0 breaks, so every break counted
    here is memtrain's. benchmarks import this to print the figure."""
    from memtrain.checkpointing import Checkpointing, compile_model

    model = _gpt3()
    Checkpointing.parse(set_up).apply(model, offloader=_cpu_offloader())
    if chunked_loss:
        apply_chunked_loss(model, chunk_tokens=16)
    compiled = compile_model(model, backend=backend)
    x = _batch(0)
    return compile_counts(lambda: compiled(x, x).backward())


def _gpt3(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, seq_len=32, dropout=dropout))


@pytest.mark.parametrize("chunked_loss", [False, True], ids=["whole-loss", "chunked-loss"])
@pytest.mark.parametrize("set_up", SET_UPS)
def test_no_graph_break_caused_by_memtrain_in_any_checkpointing_set_up(set_up, chunked_loss):
    counts = graph_break_counts(set_up, chunked_loss)
    assert counts.graph_breaks == 0 and counts.eager_frames == 0 and counts.graphs >= 1, str(counts)


@pytest.mark.parametrize("set_up", ["all+offload", "blocks(ORK)", "selective+offload"])
def test_offloaded_activations_compile_per_block_and_keep_the_gradients(set_up):
    """The offloader's hooks stay outside the compiled regions and see their saved tensors: every block compiled,
    the gradients of eager training with the same offloading (dropout on: the masks are replayed too)."""
    from memtrain.checkpointing import Checkpointing, compile_model

    eager, model = _gpt3(dropout=0.1), _gpt3(dropout=0.1)
    Checkpointing.parse(set_up).apply(eager, offloader=_cpu_offloader())
    offloader = _cpu_offloader()
    Checkpointing.parse(set_up).apply(model, offloader=offloader)
    compiled = compile_model(model, backend="aot_eager")

    def step(seed: int) -> None:
        x = _batch(seed)
        torch.manual_seed(seed)
        eager(x, x).backward()
        torch.manual_seed(seed)
        compiled(x, x).backward()

    counts = compile_counts(lambda: step(0))
    assert counts.graph_breaks == 0 and counts.eager_frames == 0 and counts.graphs >= 1, str(counts)
    step(1)  # a second step: the offloader's pool and learned order, the compiled blocks' cache
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    stats = offloader.stats()
    assert stats.offloaded_tensors > 0 and stats.host_used_bytes == 0, stats


def test_apply_plan_compiles_a_plan_with_offloaded_activations(monkeypatch):
    """apply_plan compiles the blocks of an offloading plan one by one: graphs, no break, nothing eager."""
    import functools

    import memtrain.checkpointing.wrap
    from memtrain.planner import PlanSettings, apply_plan

    monkeypatch.setattr(memtrain.checkpointing.wrap, "offload_activations", lambda **_: _cpu_offloader())
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    model = _gpt3()
    settings = PlanSettings(micro_batch_size=4, accumulation=1, blocks=("offload", "recompute", "keep"),
                            flavor="offload-inputs", chunked_loss=False, optimizer="device", distribution="none",
                            compile=True,
                            precision="fp32")
    run = apply_plan(model, settings)
    x = _batch(0)
    counts = compile_counts(lambda: run.train_model(x, x).backward())
    assert counts.graph_breaks == 0 and counts.eager_frames == 0 and counts.graphs >= 2, str(counts)


def test_compiling_a_model_with_offloaded_activations_whole_is_one_clear_error_not_a_silent_eager_run():
    from memtrain import ConfigError

    model = _gpt3()
    apply_checkpointing(model, offload=True, offloader=_cpu_offloader())
    x = _batch(0)
    with pytest.raises(ConfigError, match="compile_model"):
        torch.compile(model, backend="aot_eager")(x, x)
    torch._dynamo.reset()


def test_blocks_wrapped_again_after_compile_model_are_compiled_the_same_way():
    """A re-plan wraps the blocks again (configure_model): they stay compiled, the offloader outside each."""
    from memtrain.checkpointing import Checkpointing, compile_model

    model = _gpt3()
    offloader = _cpu_offloader()
    Checkpointing.parse("blocks(ORK)").apply(model, offloader=offloader)
    compiled = compile_model(model, backend="aot_eager")
    Checkpointing.parse("blocks(KOO)+offload").apply(model, offloader=offloader)  # block 0 kept, 1 and 2 offload
    x = _batch(0)
    counts = compile_counts(lambda: compiled(x, x).backward())
    assert counts.graph_breaks == 0 and counts.eager_frames == 0 and counts.graphs >= 2, str(counts)
    assert all(model.blocks[i].forward.compiled is not None for i in (1, 2))


def test_a_model_compiled_whole_whose_blocks_start_offloading_compiles_again_block_by_block():
    """A re-plan may make the blocks of a model compiled whole offload their activations (train follows it with
    compile_model again): the second call takes what the first returned and compiles block by block, with no
    break and nothing eager (the whole-model graph would raise: an offloader cannot be traced)."""
    from memtrain.checkpointing import Checkpointing, compile_model

    eager, model = _gpt3(), _gpt3()
    for m in (eager, model):
        Checkpointing.parse("all").apply(m, offloader=_cpu_offloader())
    compiled = compile_model(model, backend="aot_eager")
    assert compiled is not model  # nothing offloads yet: one compiled model
    x = _batch(0)
    compiled(x, x).backward()
    eager(x, x).backward()
    for m in (eager, model):
        Checkpointing.parse("all+offload").apply(m, offloader=_cpu_offloader())
    again = compile_model(compiled, backend="aot_eager")
    counts = compile_counts(lambda: again(x, x).backward())
    eager(x, x).backward()
    assert counts.graph_breaks == 0 and counts.eager_frames == 0 and counts.graphs >= 1, str(counts)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
