"""What tests build again and again, in one place: tiny models (the built-in GPT, a Hugging Face Llama), a
tokenizer trained offline on the built-in corpus, a saved pretrained folder, and ``Touches``, which records the ops
that reach given buffers. Import from test files as ``from helpers import tiny_gpt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.models import GPT, GPTConfig

TOKENIZER_VOCAB = 512
EOS, PAD = "<|endoftext|>", "<pad>"

FIGURES_TORCH = "2.13"  # the torch saved plan figures were planned with (make test's: the Makefile's TORCH)
THIS_TORCH = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def build_tokenizer(directory: Path, *, vocab_size: int = TOKENIZER_VOCAB, corpus_bytes: int = 2**19):
    """Trains a byte-level BPE on the first ``corpus_bytes`` of the built-in corpus and saves it as a
    ``PreTrainedTokenizerFast`` (eos and pad tokens set) into ``directory``; returns it."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from memtrain.data import stdlib_corpus

    text = stdlib_corpus(corpus_bytes).tobytes().decode("utf-8", "replace")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    bpe.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD)
    tokenizer.save_pretrained(directory)
    return tokenizer


def build_llama(directory: Path, *, vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0):
    """A 2-layer Llama (hidden 64) saved with ``save_pretrained`` (safetensors) into ``directory``; returns it."""
    import torch

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                                      max_position_embeddings=256, eos_token_id=eos_token_id,
                                      pad_token_id=pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return model


def tiny_gpt(n_layer: int = 2, *, n_head: int = 2, n_embd: int = 32, seq_len: int = 16, seed: int | None = None,
             **config: Any) -> GPT:
    """The built-in GPT at test size (2 layers, width 32, 16 positions unless told), seeded when ``seed`` is given."""
    if seed is not None:
        torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, seq_len=seq_len, **config))


def tiny_llama_config(**overrides: Any) -> Any:
    """A Hugging Face ``LlamaConfig`` at test size (2 layers, hidden 64, 4 heads, 2 key/value heads, vocab 128)."""
    transformers = pytest.importorskip("transformers")
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    return transformers.LlamaConfig(**{**fields, **overrides})


class Touches(TorchDispatchMode):
    """Records the aten ops (on this thread) that read or write a tensor whose storage starts at one of
    ``storages`` (data pointers): what a pass over those buffers would show."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.ops = storages, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() in self.storages for t in flat):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# -- the planner's test models and devices --------------------------------------------------------------------
MiB = 2**20


def planner_llama(layers: int = 4, hidden: int = 512, **overrides: Any) -> Any:
    """The Llama config the planner tests plan for (hidden 512, 4 layers, 8 heads, 4 key/value heads, vocab 4096)."""
    return tiny_llama_config(**{**dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                       num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                                       max_position_embeddings=2048, use_cache=False), **overrides})


def planner_gpt(layers: int = 4) -> GPT:
    """The built-in GPT the planner tests plan for (width 128, 128 positions, no dropout)."""
    return tiny_gpt(layers, n_head=4, n_embd=128, seq_len=128, vocab_size=256, dropout=0.0, seed=0)


def h100() -> Any:
    """The table's H100 profile."""
    from memtrain.planner import known_gpu

    return known_gpu("NVIDIA H100 80GB HBM3")


def fixed_cpu_profile() -> Any:
    """Fixed CPU figures: the tests do not depend on how fast (or how loaded) the machine running them is."""
    from memtrain.planner import DeviceProfile

    return DeviceProfile(name="test cpu", matmul_flops=50e9, half_efficiency_tokens=256, attention_flops=10e9,
                         memory_bandwidth=10e9, op_overhead_s=5e-6, host_to_device=5e9, device_to_host=5e9,
                         cpu_adamw=5e8, host_bandwidth=10e9, interconnect=5e9, memory_bytes=None, source="test",
                         asynchronous=False)


def fields_form(settings: Any) -> dict[str, Any]:
    """A ``PlanSettings`` in the form a memtrain before the choices saved it (each field its own key, the layout as a
    list of kinds): what a checkpoint of an earlier run holds, and ``PlanSettings.from_dict`` still reads."""
    import dataclasses

    out = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name != "optimizer_class"}
    if not settings.optimizer_class.is_adamw:
        out["optimizer_class"] = settings.optimizer_class.to_dict()
    return {**out, "blocks": list(settings.blocks), "checkpointing": settings.checkpointing}


def saved_settings(saved: Any) -> Any:
    """The ``PlanSettings`` a plan's JSON (``plan --json``'s "plan", a report's "settings") stores."""
    from memtrain.planner.settings import PlanSettings

    return PlanSettings.from_dict(saved)


# -- a short training run in a folder -----------------------------------------------------------------------------
CODE_TEXT = b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300


def code_windows(seq_len: int = 32) -> Any:
    """``CODE_TEXT`` as byte windows of ``seq_len`` tokens: a dataset the built-in GPT learns in a few steps."""
    import numpy as np

    from memtrain.data import split_windows

    return split_windows(np.frombuffer(CODE_TEXT, dtype=np.uint8).copy(), seq_len)


def quick_run_config(out: Path, **changes: Any) -> Any:
    """A one-step ``TrainConfig`` writing into ``out`` (no progress bar, no sample); ``changes`` override fields."""
    from memtrain.config import TrainConfig

    fields = {"max_steps": 1, "micro_batch_size": 2, "out_dir": str(out), "progress": False, "sample_bytes": 0,
              "lr": 1e-2, "eval_batches": 1}
    return TrainConfig(**{**fields, **changes})


def write_docs_jsonl(path: Path, paragraphs: int = 120) -> Path:
    """``path``: a .jsonl of the built-in corpus's first ``paragraphs`` paragraphs of 80 to 600 characters, one
    ``{"text": ...}`` per line (what --data takes with --hf-model)."""
    import json

    from memtrain.data import stdlib_corpus

    text = stdlib_corpus(2**19).tobytes().decode("utf-8", "replace")
    kept = [p for p in text.split("\n\n") if 80 <= len(p) <= 600][:paragraphs]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in kept))
    return path


def run_cli(argv: list[str], capsys: Any) -> tuple[int, list[str], str]:
    """(exit code, the error lines, all of stdout and stderr) of ``memtrain argv``, run in this process."""
    from memtrain.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out, err = capsys.readouterr()
    return code, [line for line in err.splitlines() if ": error:" in line], out + err
