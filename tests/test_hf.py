"""memtrain.hf: local pretrained folders in, LoRA, Hugging Face folders out, memtrain inside transformers.Trainer.

Every model here is the tiny Llama of tests/conftest.py (``hf_model_dir``), loaded from disk without the network.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys

import pytest
import torch
from torch import nn

from memtrain import ConfigError, apply_checkpointing
from memtrain.choices import Choices, OptimizerChoice
from memtrain.hf import (
    HF_DEFAULT_CHOICES,
    apply_lora,
    is_lora,
    load_pretrained,
    load_tokenizer,
    merge_lora,
    prepare_model,
    save_hf,
)
from memtrain.loss import apply_chunked_loss, chunked_loss_kind

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LOGITS_TOL = 1e-5  # the exported folder must give the trained model's logits (fp32: in fact bit for bit)


def batch(seed: int = 0, rows: int = 2, seq_len: int = 32, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


def train_steps(model: nn.Module, steps: int = 3, lr: float = 1e-2) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
    for step in range(steps):
        x = batch(step)
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def copy_folder(src, dst, *, keep) -> None:
    dst.mkdir()
    for name in keep:
        shutil.copy(src / name, dst / name)


# -- loading -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_local_folder_loads_with_its_weights_in_the_requested_dtype(hf_model_dir, dtype):
    from safetensors.torch import load_file

    model = load_pretrained(hf_model_dir, dtype=dtype)
    saved = load_file(hf_model_dir / "model.safetensors")
    assert model.training and model.config.use_cache is False
    state = model.state_dict()
    assert set(saved) <= set(state)
    for name, tensor in saved.items():
        assert state[name].dtype == dtype, name
        assert torch.equal(state[name], tensor.to(dtype)), name
    tokenizer = load_tokenizer(hf_model_dir)
    assert tokenizer.is_fast and tokenizer.eos_token_id is not None and len(tokenizer) == model.config.vocab_size


def test_bad_folders_are_one_clear_error_each(hf_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="no such folder"):
        load_pretrained(tmp_path / "nowhere")
    no_config = tmp_path / "no-config"
    copy_folder(hf_model_dir, no_config, keep=["model.safetensors", "tokenizer.json"])
    with pytest.raises(ConfigError, match="holds no config.json") as e:
        load_pretrained(no_config)
    assert len(e.value.problems) == 1
    pickles = tmp_path / "pickles"
    copy_folder(hf_model_dir, pickles, keep=["config.json"])
    (pickles / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ConfigError, match="only pickled weights.*never unpickles"):
        load_pretrained(pickles)
    empty = tmp_path / "no-weights"
    copy_folder(hf_model_dir, empty, keep=["config.json"])
    with pytest.raises(ConfigError, match=r"holds no weights \(\*.safetensors\)"):
        load_pretrained(empty)
    sharded = tmp_path / "sharded"
    copy_folder(hf_model_dir, sharded, keep=["config.json"])
    (sharded / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    with pytest.raises(ConfigError, match="lists 2 shards, 2 of them missing"):
        load_pretrained(sharded)
    with pytest.raises(ConfigError, match="holds no tokenizer.*docs.jsonl needs"):
        load_tokenizer(empty, needed_for="--data docs.jsonl")
    partial = tmp_path / "partial"  # weights for some of the model only: it would train from random values
    copy_folder(hf_model_dir, partial, keep=["config.json"])
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_model_dir / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1." not in k}, partial / "model.safetensors")
    with pytest.raises(ConfigError, match="leaves 9 of the model's weights unset"):
        load_pretrained(partial)


def test_a_missing_extra_names_the_pip_command(monkeypatch, hf_model_dir):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'memtrain\[hf\]'"):
        load_pretrained(hf_model_dir)
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ConfigError, match=r"pip install 'memtrain\[lora\]'"):
        apply_lora(nn.Linear(2, 2), 4)


# -- export --------------------------------------------------------------------------------------------------------
def test_the_exported_folder_loads_to_the_trained_models_logits(hf_model_dir, tmp_path):
    model = load_pretrained(hf_model_dir)
    apply_checkpointing(model)  # patched forwards live on the instances, not in the state dict
    apply_chunked_loss(model, chunk_tokens=16)
    train_steps(model)
    out = save_hf(model, tmp_path / "run" / "hf", tokenizer=hf_model_dir)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json"}
    assert not [p for p in out.parent.iterdir() if p.name != "hf"]  # no staging folder left behind
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert chunked_loss_kind(loaded) is None and loaded.dtype == torch.float32
    x = batch(7)
    diff = (logits(loaded, x) - logits(model, x)).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.3g} > {LOGITS_TOL}"
    assert transformers.AutoTokenizer.from_pretrained(out).encode("def f(x):") == \
        load_tokenizer(hf_model_dir).encode("def f(x):")
    save_hf(model, out)  # writing again replaces the folder as a whole (no tokenizer this time)
    assert not (out / "tokenizer.json").exists() and (out / "model.safetensors").is_file()


def test_export_refuses_a_model_hugging_face_cannot_save(tmp_path):
    with pytest.raises(ConfigError, match="has no save_pretrained"):
        save_hf(nn.Linear(2, 2), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_export_is_the_source_folder_changed_only_by_training(hf_model_dir, tmp_path):
    # What loading for training changes (use_cache off, a tokenizer loaded with local_files_only) is not exported.
    model = load_pretrained(hf_model_dir)
    assert model.config.use_cache is False
    out = save_hf(model, tmp_path / "hf", tokenizer=load_tokenizer(hf_model_dir))
    source, written = json.loads((hf_model_dir / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert source["use_cache"] is True and written["use_cache"] is True
    assert {k: v for k, v in written.items() if k != "transformers_version"} == \
        {k: v for k, v in source.items() if k != "transformers_version"}
    for name in ("tokenizer.json", "tokenizer_config.json"):  # byte for byte: no local_files_only, no is_local
        assert (out / name).read_bytes() == (hf_model_dir / name).read_bytes(), (out / name).read_text()[:400]
    # A tokenizer changed in training keeps its change, still without the keys of a local load.
    tokenizer = load_tokenizer(hf_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    changed = json.loads((save_hf(model, tmp_path / "changed", tokenizer=tokenizer) / "tokenizer_config.json")
                         .read_text())
    assert "<tool>" in json.dumps(changed) and not {"local_files_only", "is_local"} & set(changed), changed


def test_a_bf16_checkpoint_trained_in_fp32_is_exported_in_bf16_unless_told(hf_model_dir, tmp_path):
    from safetensors.torch import load_file

    bf16_dir = tmp_path / "bf16-model"
    transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    shutil.copy(hf_model_dir / "tokenizer.json", bf16_dir)
    model = load_pretrained(bf16_dir)  # fp32 master weights
    assert next(model.parameters()).dtype == torch.float32
    auto = save_hf(model, tmp_path / "auto")
    source, written = load_file(bf16_dir / "model.safetensors"), load_file(auto / "model.safetensors")
    assert written.keys() == source.keys()
    assert all(torch.equal(written[k], source[k]) for k in source)  # bf16 -> fp32 -> bf16 is exact
    assert json.loads((auto / "config.json").read_text())["dtype"] == "bfloat16"
    size = (auto / "model.safetensors").stat().st_size
    assert size <= (bf16_dir / "model.safetensors").stat().st_size * 1.01, size
    fp32 = save_hf(model, tmp_path / "fp32", dtype=torch.float32)
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "float32"
    assert {t.dtype for t in load_file(fp32 / "model.safetensors").values()} == {torch.float32}
    assert transformers.AutoModelForCausalLM.from_pretrained(auto).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="not a floating torch dtype"):
        save_hf(model, tmp_path / "bad", dtype=torch.int8)


def test_the_adapter_names_its_base_model_by_absolute_path(hf_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(hf_model_dir.parent)
    lora = apply_lora(load_pretrained(hf_model_dir.name), 2)  # loaded by a relative path, as --hf-model DIR
    out = save_hf(lora, tmp_path / "adapter")
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(hf_model_dir.absolute()), adapter["base_model_name_or_path"]
    monkeypatch.chdir(tmp_path)  # loads from anywhere
    peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        adapter["base_model_name_or_path"]), out)


# -- LoRA ------------------------------------------------------------------------------------------------------------
def test_lora_trains_only_the_adapters_and_leaves_the_base_bitwise_unchanged(hf_model_dir):
    model = load_pretrained(hf_model_dir)
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    lora = apply_lora(model, 4)
    assert is_lora(lora)
    trainable = {name for name, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    # every attention and MLP projection of both layers, A and B; never the head
    assert len(trainable) == 2 * 7 * 2 and not any("lm_head" in n for n in trainable)
    apply_checkpointing(lora)
    apply_chunked_loss(lora, chunk_tokens=16)
    adapters = {name: p.detach().clone() for name, p in lora.named_parameters() if p.requires_grad}
    train_steps(lora)
    for name, p in lora.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, adapters[name]), f"adapter {name} did not change"
    inner = lora.get_base_model().state_dict()
    for name, value in base.items():
        key = name if name in inner else name.replace(".weight", ".base_layer.weight")
        assert torch.equal(inner[key], value), f"frozen {name} changed"


def test_checkpointing_and_the_chunked_loss_keep_a_lora_models_gradients(hf_model_dir):
    """PEFT forwards attribute lookups to the causal LM it wraps (peft_model.model is the whole LM, not the
    decoder): memtrain patches the causal LM itself. Same loss and adapter gradients (fp32, rtol 1e-5)."""
    x = batch(3)

    def run(memtrain: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        base = load_pretrained(hf_model_dir)
        torch.manual_seed(0)  # LoRA's A matrices start random
        lora = apply_lora(base, 4, alpha=8)
        for name, p in lora.named_parameters():  # B starts at zero: give it values so A's gradient is not zero
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
        if memtrain:
            apply_checkpointing(lora)
            apply_chunked_loss(lora, chunk_tokens=16)
            assert chunked_loss_kind(lora) == "hf" and lora(input_ids=x, labels=x).logits is None
        loss = lora(input_ids=x, labels=x).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}

    (got_loss, got), (want_loss, want) = run(True), run(False)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        diff, scale = (got[name] - grad).abs().max().item(), grad.abs().max().item()
        assert scale > 0 and diff <= 1e-5 * scale, f"{name}: max abs diff {diff:.3g} > 1e-5 x {scale:.3g}"


def test_the_adapter_and_the_merged_export_load_to_the_trained_logits(hf_model_dir, tmp_path):
    lora = apply_lora(load_pretrained(hf_model_dir), 4)
    train_steps(lora)
    x = batch(9)
    want = logits(lora, x)
    adapter = save_hf(lora, tmp_path / "adapter", tokenizer=hf_model_dir)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert not (adapter / "model.safetensors").exists()  # the adapters only: the base is in hf_model_dir
    reloaded = peft.PeftModel.from_pretrained(load_pretrained(hf_model_dir), adapter)
    diff = (logits(reloaded, x) - want).abs().max().item()
    assert diff <= LOGITS_TOL, f"adapter export: max abs logit diff {diff:.3g} > {LOGITS_TOL}"
    merged = merge_lora(lora)
    assert not is_lora(merged) and not any("lora_" in n for n, _ in merged.named_parameters())
    out = save_hf(merged, tmp_path / "merged", tokenizer=hf_model_dir)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert set(loaded.state_dict()) == set(load_pretrained(hf_model_dir).state_dict())  # the base's own names
    diff = (logits(loaded, x) - want).abs().max().item()
    assert diff <= LOGITS_TOL, f"merged export: max abs logit diff {diff:.3g} > {LOGITS_TOL}"


def test_lora_bad_input_is_one_clear_error_each(hf_model_dir):
    no_linear = nn.Sequential(nn.Embedding(10, 4), nn.Conv1d(4, 4, 1))
    with pytest.raises(ConfigError, match="no linear layer to adapt"):
        apply_lora(no_linear, 8)
    with pytest.raises(ConfigError, match="rank must be an integer >= 1"):
        apply_lora(load_pretrained(hf_model_dir), 0)
    with pytest.raises(ConfigError, match="merge_lora: LlamaForCausalLM has no LoRA adapters"):
        merge_lora(load_pretrained(hf_model_dir))
    lora = apply_lora(load_pretrained(hf_model_dir), 2)
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        apply_lora(lora, 2)
    with pytest.raises(ConfigError, match="the config already holds them"):
        apply_lora(load_pretrained(hf_model_dir), peft.LoraConfig(r=2, target_modules=["q_proj"]), alpha=4)


def test_lora_on_memtrains_gpt():
    """Any module with linear layers: memtrain's GPT gets adapters on its blocks' projections, not on its head."""
    from memtrain.models import GPT, GPTConfig

    lora = apply_lora(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16)), 2)
    names = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and not any(".head." in n for n in names)
    x = batch(0, seq_len=16, vocab=256)
    lora(x, x).backward()
    assert all(p.grad is not None for p in lora.parameters() if p.requires_grad)


# -- the Hugging Face Trainer --------------------------------------------------------------------------------------
def test_prepare_model_says_what_it_applied(hf_model_dir):
    model = load_pretrained(hf_model_dir)
    prepared = prepare_model(model, chunk_tokens=64)
    assert prepared.checkpointed == ("model.layers.0", "model.layers.1") and prepared.chunk_tokens == 64
    # torch >= 2.13 has its own chunked op (F.linear_cross_entropy), which a plain head takes; before, memtrain's
    kernel = ("torch's kernel" if hasattr(torch.nn.functional, "linear_cross_entropy") else
              f"memtrain's kernel, because: torch {torch.__version__} has no chunked F.linear_cross_entropy")
    assert kernel in prepared.reasons[1], prepared.reasons


def test_choices_that_leave_checkpointing_and_the_loss_open_keep_the_helpers_defaults(hf_model_dir):
    """Asking only for the offloaded optimizer keeps TrainerMemory's old defaults (every layer checkpointed, the
    loss chunked): an open choice is the helper's default, not off; "none" / False turn them off."""
    offloaded = Choices(optimizer=OptimizerChoice(placement="offload"))
    prepared = prepare_model(load_pretrained(hf_model_dir), offloaded)
    assert prepared.checkpointed == ("model.layers.0", "model.layers.1") and prepared.chunk_tokens == 1024
    off = prepare_model(load_pretrained(hf_model_dir), Choices(checkpointing="none", chunked_loss=False))
    assert off.checkpointed == () and off.chunk_tokens is None


@pytest.mark.parametrize("policy", [None, "none", "all", "every:2", "blocks(RK)", "selective", "all+offload"])
def test_prepare_model_applies_any_checkpointing_policy(hf_model_dir, policy):
    """A Choices' policy reaches the model as Checkpointing.apply applies it; None (left open) is the helper's
    default, every layer checkpointed."""
    from memtrain.checkpointing import Checkpointing

    model, twin = load_pretrained(hf_model_dir), load_pretrained(hf_model_dir)
    prepared = prepare_model(model, Choices(checkpointing=policy, chunked_loss=False))
    want = Checkpointing.parse(policy or "all").apply(twin)
    assert list(prepared.checkpointed) == want and prepared.chunk_tokens is None
    assert [type(m) for m in model.modules()] == [type(m) for m in twin.modules()]
    assert len(prepared.reasons) == 1
    if policy != "none":
        assert prepared.checkpointed and (policy or "all") in prepared.reasons[0], prepared.reasons
    assert HF_DEFAULT_CHOICES == Choices(checkpointing="all", chunked_loss=True)


REFUSED = {
    "state_precision": (Choices(optimizer=OptimizerChoice(state_precision="bf16")), "add placement=.offload."),
    "step_in_backward": (Choices(optimizer=OptimizerChoice(step_in_backward=True)), "drop step_in_backward"),
    "offload_fraction": (Choices(optimizer=OptimizerChoice(offload_fraction=0.5)), "placement='offload'"),
    "compile": (Choices(compile=True), r"TrainingArguments\(torch_compile=True\)"),
    # issue 33: these two were ignored in silence
    "pure_bf16": (Choices(pure_bf16=True), "drop pure_bf16.*memtrain train --pure-bf16"),
    "offload_weights": (Choices(offload_weights=True), "drop offload_weights.*memtrain train --offload-weights"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_choice_the_trainer_cannot_honour_is_a_config_error_naming_the_fix(hf_model_dir, tmp_path, name):
    from memtrain.hf import MemtrainTrainer

    choices, fix = REFUSED[name]
    model = load_pretrained(hf_model_dir)
    with pytest.raises(ConfigError, match=f"{name}.*To resolve this error.*{fix}") as info:
        prepare_model(model, choices)
    assert len(info.value.problems) == 1, info.value.problems
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ConfigError, match=f"{name}.*{fix}"):
        MemtrainTrainer(model, args, memory=choices)


def test_every_refused_choice_is_named_in_one_config_error(hf_model_dir):
    everything = Choices(compile=True, optimizer=OptimizerChoice(state_precision="int8", offload_fraction=0.25))
    with pytest.raises(ConfigError) as info:
        prepare_model(load_pretrained(hf_model_dir), everything)
    assert len(info.value.problems) == 3 and all("To resolve this error" in p for p in info.value.problems)
    # the off values of the same choices are honoured (nothing to do)
    off = Choices(checkpointing="all", optimizer=OptimizerChoice(step_in_backward=False, offload_fraction=0.0))
    assert prepare_model(load_pretrained(hf_model_dir), off).checkpointed


@pytest.fixture(scope="module")
def packed_rows(hf_model_dir, tmp_path_factory):
    """The built-in corpus as a .txt, tokenised with the fixture's tokenizer and packed into rows of 64."""
    from memtrain.data import PackedRows, stdlib_corpus, tokenize_file

    text = tmp_path_factory.mktemp("data") / "stdlib.txt"
    text.write_bytes(stdlib_corpus(2**15).tobytes())
    return PackedRows(tokenize_file(text, load_tokenizer(hf_model_dir)), seq_len=64)


@pytest.mark.parametrize("offload_optimizer", [True, False], ids=["CPUOffloadOptimizer", "AdamW"])
def test_trainer_steps_equal_memtrains_own_loop(hf_model_dir, packed_rows, tmp_path, offload_optimizer):
    """3 Trainer steps (2 micro-batches each, linear warmup schedule, clipping at 0.5, weight decay) give the
    weights of memtrain's loop (GradientAccumulator, the same optimizer and schedule) on the same batches.

    Tolerance: fp32 AdamW; the Trainer divides each micro-batch's loss by the window's token count before
    backward, the accumulator scales the summed gradient once after it, so the gradients differ in the last
    bits, which Adam's division by sqrt(v) amplifies where a gradient is near zero: 1e-6 absolute (the learning
    rate is 1e-3)."""
    from memtrain import CPUOffloadOptimizer, GradientAccumulator
    from memtrain.data import hf_collate
    from memtrain.hf import MemtrainTrainer

    seen = []

    def collate(rows):
        seen.append(hf_collate(rows))
        return seen[-1]

    memory = Choices(checkpointing="all", chunked_loss=True,
                     optimizer=OptimizerChoice(placement="offload" if offload_optimizer else None))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=3, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=1, lr_scheduler_type="linear",
        weight_decay=0.1, max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = MemtrainTrainer(load_pretrained(hf_model_dir), args, memory=memory, chunk_tokens=32,
                              train_dataset=packed_rows, data_collator=collate)
    assert trainer.prepared.chunk_tokens == 32 and len(trainer.prepared.checkpointed) == 2
    trainer.train()
    optimizer_type = type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer)
    assert (optimizer_type is CPUOffloadOptimizer) == offload_optimizer, optimizer_type
    trainer_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]

    model = load_pretrained(hf_model_dir)
    prepare_model(model, memory, chunk_tokens=32)
    decay = set(trainer.get_decay_parameter_names(model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    optimizer = (CPUOffloadOptimizer(groups, torch.optim.AdamW, lr=1e-3) if offload_optimizer else
                 torch.optim.AdamW(groups, lr=1e-3))
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=3)
    acc = GradientAccumulator(model, optimizer, steps=2, scheduler=scheduler, max_grad_norm=0.5)
    norms = []
    for window in (seen[0:2], seen[2:4], seen[4:6]):
        for i, b in enumerate(window):
            with acc.micro_batch(is_last=i == len(window) - 1):
                loss = model(input_ids=b["input_ids"], labels=b["labels"], shift_labels=b["shift_labels"],
                             position_ids=b["position_ids"], num_items_in_batch=1).loss  # the summed loss
                acc.backward(loss, reduction="sum", items=(b["shift_labels"] != -100).sum())
        norms.append(acc.step().grad_norm)
    assert trainer_norms == pytest.approx(norms, rel=1e-5), (trainer_norms, norms)
    assert min(norms) > 0.5  # clipping was active in every step
    for (name, p), q in zip(trainer.model.named_parameters(), model.parameters(), strict=True):
        diff = (p.detach() - q.detach()).abs().max().item()
        assert diff <= 1e-6, f"{name}: max abs diff {diff:.3g} > 1e-6"


def test_a_lora_model_takes_memtrains_summed_loss_call(hf_model_dir):
    """train()'s call for a chunked Hugging Face loss (labels already shifted, num_items_in_batch=1: the summed
    loss) reaches the causal LM through PEFT's wrapper, and equals the plain model's summed loss."""
    from memtrain.loss import language_model_loss

    x = batch(5)
    y = torch.roll(x, -1, dims=1)
    y[:, -1] = -100
    torch.manual_seed(0)
    plain = apply_lora(load_pretrained(hf_model_dir), 4)
    want = torch.nn.functional.cross_entropy(plain(input_ids=x).logits.flatten(0, 1), y.flatten(), reduction="sum")
    apply_chunked_loss(plain, chunk_tokens=16)
    got = language_model_loss(plain, x, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_estimate_of_a_lora_model_with_a_chunked_loss_equals_measure_on_the_cpu(hf_model_dir):
    from memtrain import MemoryMeter, estimate

    lora = apply_lora(load_pretrained(hf_model_dir), 4)
    apply_checkpointing(lora)
    apply_chunked_loss(lora)
    x = batch(1)
    with MemoryMeter(lora) as meter:
        loss = lora(input_ids=x, labels=x).loss
    loss.backward()
    predicted = estimate(lora, x, device="cpu", checkpointing="all", setup=Choices(chunked_loss=True))
    assert predicted.activation_bytes == meter.activation_bytes, (predicted.activation_bytes, meter.activation_bytes)


@pytest.mark.parametrize("offload", [None, True], ids=["off", "offload_activations"])
def test_the_trainer_wraps_each_training_step_in_the_activation_offloader(hf_model_dir, packed_rows, tmp_path,
                                                                          monkeypatch, offload):
    """Choices(offload_activations=True): every training step runs inside memtrain.offload_activations(model=...)
    (a recording stand-in here: on the CPU the real one does nothing); None: no offloader."""
    import memtrain.offload
    from memtrain.data import hf_collate
    from memtrain.hf import MemtrainTrainer

    entered = []

    class Recorder(contextlib.nullcontext):
        def __enter__(self):
            entered.append(True)

    monkeypatch.setattr(memtrain.offload, "offload_activations", lambda **kwargs: Recorder())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                                          save_strategy="no", report_to="none", use_cpu=True,
                                          dataloader_num_workers=0, disable_tqdm=True)
    trainer = MemtrainTrainer(load_pretrained(hf_model_dir), args, memory=Choices(offload_activations=offload),
                              train_dataset=packed_rows, data_collator=hf_collate)
    trainer.train()
    assert len(entered) == (2 if offload else 0), entered


def test_the_trainer_refuses_checkpointing_twice(hf_model_dir, tmp_path):
    from memtrain.hf import MemtrainTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, use_cpu=True,
                                          report_to="none")
    with pytest.raises(ConfigError, match="checkpoint every layer twice"):
        MemtrainTrainer(load_pretrained(hf_model_dir), args)
    with pytest.raises(ConfigError, match="must be a memtrain.choices.Choices"):
        MemtrainTrainer(load_pretrained(hf_model_dir), args, memory={"checkpointing": False})


def test_the_trainer_trains_lora_adapters_with_the_offloaded_optimizer(hf_model_dir, packed_rows, tmp_path):
    """The module docstring's recipe: LoRA + CPUOffloadOptimizer in the Trainer; the base stays bitwise equal,
    every adapter changes, and the adapter export loads with PEFT to the trained logits."""
    from memtrain.data import hf_collate
    from memtrain.hf import MemtrainTrainer

    torch.manual_seed(0)
    lora = apply_lora(load_pretrained(hf_model_dir), 4)
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=2,
                                          per_device_train_batch_size=2, learning_rate=1e-2, save_strategy="no",
                                          report_to="none", use_cpu=True, dataloader_num_workers=0,
                                          disable_tqdm=True)
    memory = Choices(checkpointing="all", chunked_loss=True,
                     optimizer=OptimizerChoice(placement="offload", state_precision="bf16"))
    trainer = MemtrainTrainer(lora, args, memory=memory, train_dataset=packed_rows, data_collator=hf_collate)
    trainer.train()
    from memtrain import CPUOffloadOptimizer

    opt = trainer.optimizer
    while not isinstance(opt, CPUOffloadOptimizer):  # inside accelerate's wrapper
        opt = opt.optimizer
    assert opt.state_precision == "bf16" and {e["exp_avg"].dtype for e in opt.state.values()} == {torch.bfloat16}
    for name, p in lora.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == p.requires_grad, f"{name}: changed={changed}, trainable={p.requires_grad}"
    out = save_hf(trainer.model, tmp_path / "hf")
    x = batch(2)
    reloaded = peft.PeftModel.from_pretrained(load_pretrained(hf_model_dir), out)
    diff = (logits(reloaded, x) - logits(lora, x)).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.3g} > {LOGITS_TOL}"


def test_the_trainer_steps_a_named_optimizer_on_the_host(hf_model_dir, packed_rows, tmp_path):
    """OptimizerChoice(name="adafactor", placement="offload"): CPUOffloadOptimizer steps Adafactor with the
    Trainer's learning rate (its factored state on the host); on the device the Trainer's own optimizer would be
    built, so that is refused naming optim=."""
    from memtrain import CPUOffloadOptimizer
    from memtrain.data import hf_collate
    from memtrain.hf import MemtrainTrainer

    model = load_pretrained(hf_model_dir)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=1,
                                          per_device_train_batch_size=2, learning_rate=1e-2, save_strategy="no",
                                          report_to="none", use_cpu=True, dataloader_num_workers=0,
                                          disable_tqdm=True)
    memory = Choices(optimizer=OptimizerChoice(name="adafactor", placement="offload"))
    trainer = MemtrainTrainer(model, args, memory=memory, train_dataset=packed_rows, data_collator=hf_collate)
    trainer.train()
    opt = trainer.optimizer
    while not isinstance(opt, CPUOffloadOptimizer):  # inside accelerate's wrapper
        opt = opt.optimizer
    inner = opt._buckets[0].inner
    assert type(inner) is torch.optim.Adafactor and inner.defaults["lr"] == 1e-2
    assert any("row_var" in e for e in opt.state.values())
    with pytest.raises(ConfigError, match="optim="):
        MemtrainTrainer(load_pretrained(hf_model_dir), args, train_dataset=packed_rows, data_collator=hf_collate,
                        memory=Choices(optimizer=OptimizerChoice(name="adafactor")))


# -- errors keep their cause and name arguments, not CLI flags -----------------------------------------------------
def _multi_line_error() -> OSError:
    try:
        raise KeyError("'rope_scaling' has an unknown 'type'")
    except KeyError as cause:
        error = OSError("Error while loading the model.\nStep 1 of 3 went fine.\nThe real reason: bad rope_scaling.")
        error.__cause__ = cause
        return error


@pytest.mark.parametrize("what", ["model", "tokenizer"])
def test_a_hugging_face_error_keeps_its_last_line_and_its_cause(hf_model_dir, monkeypatch, what):
    error = _multi_line_error()

    def fail(*args, **kwargs):
        raise error

    if what == "model":
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
        call = lambda: load_pretrained(hf_model_dir)  # noqa: E731
    else:
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
        call = lambda: load_tokenizer(hf_model_dir)  # noqa: E731
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    for fragment in ("OSError: Error while loading the model.", "The real reason: bad rope_scaling.",
                     "KeyError", "unknown 'type'", "To resolve this error"):
        assert fragment in message, f"{fragment!r} lost from: {message}"


def test_hf_errors_name_the_argument_not_a_cli_flag(hf_model_dir, tmp_path):
    import re

    no_weights = tmp_path / "no-weights"
    copy_folder(hf_model_dir, no_weights, keep=["config.json"])
    calls = {
        "no folder": lambda: load_pretrained(tmp_path / "nowhere"),
        "no weights": lambda: load_pretrained(no_weights),
        "bad rank": lambda: apply_lora(nn.Linear(4, 4), 0),
        "no linear": lambda: apply_lora(nn.Sequential(nn.Embedding(10, 4), nn.Conv1d(4, 4, 1)), 8),
        "nothing to merge": lambda: merge_lora(nn.Linear(4, 4)),
    }
    for case, call in calls.items():
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert not re.search(r"(?<![\w-])--[a-z]", message), f"{case}: a CLI flag in a library error: {message}"
        assert "To resolve this error" in message, message
    with pytest.raises(ConfigError, match=r"path='.*nowhere': no such folder"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"r=0: the LoRA rank must be an integer >= 1.*pass e.g. r=8"):
        apply_lora(nn.Linear(4, 4), 0)
