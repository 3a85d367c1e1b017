"""memtrain train on real workloads: a pretrained Hugging Face folder fine-tuned on a .jsonl file (fully, with LoRA,
with the optimizer offloaded), its hf/ folder loaded back by Hugging Face, and --resume bit for bit.

The model is the tiny Llama + tokenizer of tests/conftest.py (``hf_model_dir``); the documents are the built-in
corpus's first paragraphs. The trained model is the one ``train()`` received (a spy around it), so the exported
folder is compared with what was trained, not with another export.
"""

from __future__ import annotations

import importlib
import json
import signal
from pathlib import Path

import pytest
import torch

from memtrain.cli import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LOGITS_TOL = 1e-5  # hf/ must give the trained model's logits (fp32 on the CPU)
STEPS = 20
VARIANTS = {  # name: extra flags
    "full": [],
    "lora": ["--lora", "8", "--lr", "1e-2"],
    "offload-optimizer": ["--offload-optimizer"],
}


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    """docs.jsonl: 400 paragraphs of the standard library's source, one {"text": ...} per line."""
    from memtrain.data import stdlib_corpus

    text = stdlib_corpus(2**20).tobytes().decode("utf-8", "replace")
    paragraphs = [p for p in text.split("\n\n") if 80 <= len(p) <= 600][:400]
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return path


def _argv(hf_model_dir: Path, docs: Path, out: Path, extra: list[str], steps: int = STEPS) -> list[str]:
    # --lr: the tiny Llama is random weights saved as a pretrained folder; fine-tuning's 2e-5 would barely move it.
    return ["train", "--hf-model", str(hf_model_dir), "--data", str(docs), "--seq-len", "64", "--lr", "3e-3",
            "--max-steps", str(steps), "--micro-batch-size", "4", "--global-batch-size", "4", "--save-every", "5",
            "--eval-every", "10", "--no-progress", "--out", str(out), *extra]


class Spy:
    """Wraps memtrain.train.train (which memtrain train imports when it runs) to keep the model it trained."""

    def __init__(self, monkeypatch):
        self.models: list[torch.nn.Module] = []
        train_module = importlib.import_module("memtrain.train")  # memtrain.train is also the function
        real = train_module.train

        def train(model, data, config, **kwargs):
            self.models.append(model)
            return real(model, data, config, **kwargs)

        monkeypatch.setattr(train_module, "train", train)


def _stop_after(monkeypatch, step: int) -> None:
    """A SIGTERM arrives during step ``step`` (as a scheduler's would): the run stops after it, with a checkpoint."""
    from memtrain.run import MetricsLog

    real = MetricsLog.append

    def append(self, line):
        real(self, line)
        if line["step"] == step:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(MetricsLog, "append", append)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    x = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def _fresh(hf_model_dir: Path, trained: torch.nn.Module, lora: bool) -> torch.nn.Module:
    """A model without memtrain's patches holding the trained weights (the state dict has no patches in it)."""
    from memtrain.hf import apply_lora, load_pretrained

    fresh = load_pretrained(hf_model_dir)
    fresh = apply_lora(fresh, 8) if lora else fresh
    fresh.load_state_dict(trained.state_dict())
    return fresh


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_model_dir, docs):
    """Each variant trained once for 20 steps, uninterrupted: {variant: (run folder, the trained model)}."""
    done = {}
    for name, extra in VARIANTS.items():
        with pytest.MonkeyPatch.context() as monkeypatch:
            spy = Spy(monkeypatch)
            out = tmp_path_factory.mktemp("runs") / name
            assert main(_argv(hf_model_dir, docs, out, extra)) == 0
            done[name] = (out, spy.models[-1])
    return done


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fine_tuning_a_pretrained_folder_lowers_the_loss_and_hf_loads_to_the_trained_logits(
        variant, runs, hf_model_dir):
    out, trained = runs[variant]
    losses = _losses(out)
    assert len(losses) == STEPS
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    # LoRA adapts the blocks of a random-init base with its lm_head frozen: no unigram shortcut, a slower fall
    drop = 0.05 if variant == "lora" else 0.1
    assert last < first - drop, f"{variant}: loss {first:.3f} over the first 4 steps, {last:.3f} over the last 4"
    config = json.loads((out / "config.json").read_text())["command"]
    assert config["hf_model"] == str(hf_model_dir.absolute()) and config["data"].endswith("docs.jsonl")
    lora = variant == "lora"
    hf = out / "hf"
    assert (hf / "tokenizer.json").is_file(), sorted(p.name for p in hf.iterdir())
    if lora:
        assert (hf / "adapter_model.safetensors").is_file() and not (hf / "model.safetensors").exists()
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir, local_files_only=True)
        loaded = peft.PeftModel.from_pretrained(base, hf)
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(hf, local_files_only=True)
        assert next(loaded.parameters()).dtype == torch.float32
    vocab = loaded.config.vocab_size
    got, want = _logits(loaded, vocab), _logits(_fresh(hf_model_dir, trained, lora), vocab)
    diff = (got - want).abs().max().item()
    assert diff <= LOGITS_TOL, f"{variant}: hf/ logits differ from the trained model's by {diff:.2e} > {LOGITS_TOL}"


def test_lora_changes_only_the_adapters_and_merge_lora_writes_the_merged_model(runs, hf_model_dir, docs, tmp_path,
                                                                               monkeypatch):
    from memtrain.hf import load_pretrained

    _, trained = runs["lora"]
    original = load_pretrained(hf_model_dir).state_dict()
    adapters, frozen = 0, 0
    for name, param in trained.named_parameters():
        if "lora_" in name:
            assert param.requires_grad, name
            adapters += 1
            if "lora_B" in name:  # initialised at zero: any training moves it
                assert param.abs().max() > 0, f"{name} never trained"
            continue
        assert not param.requires_grad, f"{name} trains under --lora"
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(param, original[key]), f"{key}: a frozen weight changed"
        frozen += 1
    assert adapters > 0 and frozen == len(original), (adapters, frozen, len(original))
    # --merge-lora: the same training, hf/ a plain folder whose weights hold the adapters.
    out = tmp_path / "merged"
    assert main(_argv(hf_model_dir, docs, out, [*VARIANTS["lora"], "--merge-lora"])) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True)
    assert not (out / "hf" / "adapter_config.json").exists()
    vocab = merged.config.vocab_size
    got, want = _logits(merged, vocab), _logits(_fresh(hf_model_dir, trained, lora=True), vocab)
    diff = (got - want).abs().max().item()
    assert diff <= LOGITS_TOL, f"merged hf/ logits differ from the adapters' by {diff:.2e} > {LOGITS_TOL}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_run_stopped_at_step_10_and_resumed_equals_the_uninterrupted_one_bit_for_bit(
        variant, runs, hf_model_dir, docs, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "stopped"
    with monkeypatch.context() as stopping:
        _stop_after(stopping, 10)
        assert main(_argv(hf_model_dir, docs, out, VARIANTS[variant])) == 143  # SIGTERM's: not a success
    assert len(_losses(out)) == 10 and not (out / "model.safetensors").exists(), "the run was meant to stop"
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0, capsys.readouterr().err
    assert "resumed from step 10" in capsys.readouterr().err
    uninterrupted, _ = runs[variant]
    assert _losses(out) == _losses(uninterrupted), "the resumed steps computed other losses"
    for name in (["hf/adapter_model.safetensors"] if variant == "lora" else ["hf/model.safetensors"]):
        a, b = load_file(out / name), load_file(uninterrupted / name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{variant}: {name}:{key} differs after the resume"


@pytest.mark.parametrize("tied", [False, True])
def test_frozen_linear_weights_in_the_autocast_dtype_change_no_number(tied):
    """Under bf16-mixed, --lora stores the frozen linear weights in bf16: autocast casts them so for every matmul,
    so the loss and the adapters' gradients are bit for bit those of the fp32 base, in half the weight bytes. A
    head tied to the embedding (read outside a matmul) keeps its dtype."""
    import copy

    from helpers import tiny_llama_config

    from memtrain.cli.workloads import frozen_linear_weights_to
    from memtrain.hf import apply_lora

    torch.manual_seed(0)
    fp32 = apply_lora(transformers.LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=tied)), 4)
    for name, p in fp32.named_parameters():  # PEFT starts lora_B at zero: make every gradient count
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    half = copy.deepcopy(fp32)
    frozen_linear_weights_to(half, torch.bfloat16)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (fp32, half):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x.clone()).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(*losses), losses
    for (name, a), b in zip(fp32.named_parameters(), half.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name
    dtypes = {name: p.dtype for name, p in half.named_parameters()}
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] == torch.float32
    assert dtypes["base_model.model.model.embed_tokens.weight"] == torch.float32  # read by index, not a matmul
    head = half.get_output_embeddings().weight
    assert head.dtype == (torch.float32 if tied else torch.bfloat16), head.dtype
    assert (head is half.get_input_embeddings().weight) == tied
