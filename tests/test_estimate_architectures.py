"""estimate over the installed transformers' causal-LM architectures: every type whose tiny config trains a real
step on the CPU is estimated (>= 95% of them, every mixture-of-experts family included); on MoE models the estimate
equals measure's bytes, checkpointing finds the decoder layers as blocks, and a module that reads a value computed
from the data is named in one line.

``python tests/test_estimate_architectures.py`` prints the coverage and each failure.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from memtrain import apply_checkpointing, measure, remove_checkpointing
from memtrain.checkpointing import find_blocks
from memtrain.cli import main
from memtrain.errors import MemtrainError
from memtrain.estimate import estimate

transformers = pytest.importorskip("transformers")

B, T = 2, 16
# The tiny sizes every config is cut down to (fields missing from a config are left alone).
TINY = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "dim": 64, "emb_dim": 64, "d_embed": 64,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "n_inner": 64, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "ffn_hidden_size": 64, "dense_intermediate_size": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "head_dim": 16,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 32,
    "rotary_dim": 8,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "top_k": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "vocab_size": 256, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
}
_PER_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
# Mixture-of-experts families: their config names a count of experts.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
MAX_PARAMETERS = 20_000_000  # a config whose tiny version is still larger is not a tiny config


def _set(config, key, value):
    try:
        setattr(config, key, value)
    except Exception:  # noqa: BLE001 - a config may refuse a field (per-layer attributes, validators)
        pass


def shrink(config, depth: int = 0):
    """``config`` cut down to TINY sizes, its sub-configs (text_config, ...) too; per-layer lists cut to the layers.
    A config with as many key/value heads as heads (multi-head latent attention needs it) keeps them equal."""
    fields = config.to_dict()
    every_head = fields.get("num_key_value_heads") == fields.get("num_attention_heads") is not None
    for key, value in list(fields.items()):
        sub = getattr(config, key, None)
        if isinstance(sub, transformers.PretrainedConfig) and depth < 2:
            shrink(sub, depth + 1)
        elif key in TINY and isinstance(value, int) and not isinstance(value, bool) and value > TINY[key]:
            _set(config, key, TINY[key])
    if every_head:
        _set(config, "num_key_value_heads", config.num_attention_heads)
    layers = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers")
                   if isinstance(getattr(config, k, None), int)), None)
    for key in _PER_LAYER_LISTS:
        value = getattr(config, key, None)
        if isinstance(value, list) and layers and len(value) > layers:
            _set(config, key, value[:layers])
    vocab = getattr(config, "vocab_size", None)
    for key in _TOKEN_IDS:
        value = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
            _set(config, key, vocab - 1)
    _set(config, "use_cache", False)
    return config


def tiny_config(model_type: str):
    return shrink(transformers.AutoConfig.for_model(model_type))


def is_moe(config) -> bool:
    configs = [config, *(v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig))]
    return any(isinstance(getattr(c, f, None), int) and getattr(c, f) > 1 for c in configs for f in _EXPERT_FIELDS)


def trains(config) -> bool:
    """Whether a real step (forward with labels, backward) of the tiny model runs on the CPU."""
    try:
        with torch.device("meta"):  # counted before it is built: a config still large after shrink() is skipped
            if sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()) > \
                    MAX_PARAMETERS:
                return False
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.train()
        x = torch.randint(0, 200, (B, T), generator=torch.Generator().manual_seed(0))
        model(input_ids=x, labels=x.clone()).loss.backward()
        return True
    except Exception:  # noqa: BLE001 - any failure means the type is out of the walk
        return False


def walk(every_dense: int = 1) -> tuple[list[str], list[str], dict[str, str]]:
    """(types whose tiny config trains, of them the MoE ones, type -> estimate's failure, or for an MoE type
    find_blocks' finding none).

    ``every_dense=k`` walks every MoE family (a ``_text`` variant of a type walked is the same family) and every
    k-th of the other types, in sorted order: the same sample on every run."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    trained, moe, failures = [], [], {}
    types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    dense_seen = 0
    for model_type in types:
        try:
            config = tiny_config(model_type)
        except Exception:  # noqa: BLE001 - a type whose default config cannot be built is out of the walk
            continue
        family = model_type.removesuffix("_text")
        mixture = is_moe(config)
        if mixture and every_dense > 1 and family != model_type and family in types:
            continue
        if not mixture:
            dense_seen += 1
            if (dense_seen - 1) % every_dense:
                continue
        if not trains(config):
            continue
        trained.append(model_type)
        if mixture:
            moe.append(model_type)
        try:
            estimate(config, (B, T), device="cpu")
        except Exception as e:  # noqa: BLE001 - every failure is listed
            failures[model_type] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        if mixture:  # checkpointing and the planner need the decoder layers as blocks
            with torch.device("meta"):
                blocks = find_blocks(transformers.AutoModelForCausalLM.from_config(config))
            if not blocks:
                failures[model_type] = "find_blocks found no repeated blocks"
    return trained, moe, failures


def _coverage_line(trained: list[str], failures: dict[str, str]) -> str:
    return f"estimate works on {len(trained) - len(failures)} of {len(trained)} causal-LM types that train"


@pytest.mark.slow
def test_estimate_covers_the_causal_lm_types_that_train():
    # Every MoE family and a third of the others (the whole walk: python tests/test_estimate_architectures.py).
    trained, moe, failures = walk(every_dense=3)
    listed = "\n".join(f"  {t}: {why}" for t, why in failures.items())
    assert len(trained) >= 70, f"only {len(trained)} types trained: the tiny configs are broken"
    assert len(moe) >= 40, f"only {len(moe)} MoE types trained: {moe}"
    assert len(trained) - len(failures) >= 0.95 * len(trained), f"{_coverage_line(trained, failures)}:\n{listed}"
    # Every MoE family traces, but one whose router reads its token counts (JetMoE's .tolist()): named in one line.
    moe_failures = {t: why for t, why in failures.items() if t in moe}
    assert set(moe_failures) <= {"jetmoe"}, moe_failures
    print(_coverage_line(trained, failures), listed, sep="\n")


# -- MoE: estimate equals measure, checkpointing finds the blocks ------------------------------------------------
def tiny_moe(model_type: str):
    config = tiny_config(model_type)
    assert is_moe(config), model_type
    return config


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("policy", ["none", "all"])
def test_moe_estimate_equals_measure_on_cpu(model_type, policy):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe(model_type))
    assert model.config._experts_implementation == "grouped_mm"  # the kernel the real run uses
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    if policy == "all":
        apply_checkpointing(model)
    try:
        measured = measure(lambda: model(input_ids=x, labels=x.clone()), model=model, optimizer=optimizer)
    finally:
        remove_checkpointing(model)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    model.zero_grad(set_to_none=True)
    estimated = estimate(model, x, device="cpu", checkpointing=policy)
    assert estimated.activation_bytes == measured.activation_bytes, (estimated.activation_bytes,
                                                                       measured.activation_bytes)
    assert estimated.gradient_bytes == measured.gradient_bytes == estimated.parameter_bytes
    # AdamW's moments and fused AdamW's 4-byte step counters, as the optimizer holds them after its first step.
    assert estimated.optimizer_state_bytes == state, (estimated.optimizer_state_bytes, state)


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_moe_estimate_equals_measure_in_16_bits(model_type):
    # bf16 autocast: grouped_mm is not on its lists, transformers runs it in the weights' dtype (fp32); bf16 weights:
    # torch's own bf16 kernel.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe(model_type))
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = measure(lambda: model(input_ids=x, labels=x.clone()), model=model)
    model.zero_grad(set_to_none=True)
    assert estimate(model, x, device="cpu", precision="bf16-mixed").activation_bytes == measured.activation_bytes
    model.to(torch.bfloat16)
    measured = measure(lambda: model(input_ids=x, labels=x.clone()), model=model)
    model.zero_grad(set_to_none=True)
    assert estimate(model, x, device="cpu").activation_bytes == measured.activation_bytes


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "olmoe"])
def test_moe_decoder_layers_are_the_blocks(model_type):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_moe(model_type))
    assert find_blocks(model) == [f"model.layers.{i}" for i in range(2)], find_blocks(model)
    # Expert weights are counted: the checkpointed estimate's parameters are the whole model's.
    report = estimate(tiny_moe(model_type), (B, T), device="cpu", checkpointing="all")
    assert report.parameter_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_router_that_reads_its_token_counts_is_named_in_one_line():
    with pytest.raises(MemtrainError) as caught:
        estimate(tiny_moe("jetmoe"), (B, T), device="cpu")
    message = str(caught.value)
    assert "model.layers.0" in message and "\n" not in message, message
    assert "batch's shape" not in message, message



# -- memtrain train on MoE configs -------------------------------------------------------------------------------
@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"def f(x):\n    return x + 1\n\n" * 400)
    return path


def _train(tmp_path, text_file, model_type, *flags):
    tiny_moe(model_type).save_pretrained(tmp_path / model_type)
    return main(["train", "--hf-config", str(tmp_path / model_type / "config.json"), "--data", str(text_file),
                 "--seq-len", "32", "--max-steps", "5", "--no-progress", "--out", str(tmp_path / "run"), "--json",
                 "--overwrite", *flags])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["all", "none"])
def test_train_a_tiny_mixtral_config(tmp_path, text_file, capsys, policy):
    assert _train(tmp_path, text_file, "mixtral", "--micro-batch-size", "2", "--checkpointing", policy) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["steps"] == 5 and result["checkpointed_blocks"] == (
        ["model.layers.0", "model.layers.1"] if policy == "all" else []), result
    # The plan's estimate is exact on the CPU: the saved activations it predicted are what step 2 measured.
    assert "(+0.0%)" in captured.err and "Traceback" not in captured.err, captured.err


@pytest.mark.slow
def test_train_a_model_the_estimate_cannot_trace(tmp_path, text_file, capsys):
    # Techniques left to the planner: one line, the cause and the flags that fix them.
    assert _train(tmp_path, text_file, "jetmoe", "--checkpointing", "all") == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "the planner cannot estimate JetMoeForCausalLM: 'model.layers.0' reads a tensor value" in line, err
    assert "--no-chunked-loss, --no-offload-optimizer, --optimizer-state 'fp32', --no-step-in-backward, " \
           "--micro-batch-size" in line, err
    assert "Traceback" not in err and "batch's shape" not in err, err
    # Every technique fixed: it trains, the plan check off and why.
    assert _train(tmp_path, text_file, "jetmoe", "--checkpointing", "all", "--no-chunked-loss",
                  "--no-offload-optimizer", "--optimizer-state", "fp32", "--no-step-in-backward",
                  "--micro-batch-size", "2") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["steps"] == 5
    assert "plan check off, because: the estimate cannot trace JetMoeForCausalLM" in captured.err, captured.err


if __name__ == "__main__":
    start = time.time()
    trained, moe, failures = walk()
    print(_coverage_line(trained, failures) + f" ({len(moe)} MoE types; {time.time() - start:.0f} s)")
    for model_type, why in failures.items():
        print(f"  {model_type}{' (MoE)' if model_type in moe else ''}: {why}")
    sys.exit(0)
