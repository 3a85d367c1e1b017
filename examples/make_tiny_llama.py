"""Makes a tiny pretrained-style Hugging Face folder offline, to try `memtrain train --hf-model` without a download:
a 2-layer Llama (hidden 64, random weights, safetensors) and a byte-level BPE tokenizer trained on the built-in
corpus (the Python standard library's source). Needs the `hf` extra (transformers, tokenizers).

    .venv/bin/python examples/make_tiny_llama.py my-llama
"""

from __future__ import annotations

import argparse
from pathlib import Path

EOS, PAD = "<|endoftext|>", "<pad>"


def make_tiny_llama(folder: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors and the tokenizer's files into ``folder``; returns it."""
    import tokenizers
    import torch
    import transformers

    from memtrain.data import stdlib_corpus

    text = stdlib_corpus(2**19).tobytes().decode("utf-8", "replace")  # 512 KiB: a tokenizer in seconds
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD)
    tokenizer.save_pretrained(folder)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                      max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    transformers.utils.logging.disable_progress_bar()  # one file: no "Writing model shards" bar
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the model folder (e.g. my-llama)")
    folder = make_tiny_llama(parser.parse_args().folder)
    print(f"wrote {folder}/: a 2-layer Llama with random weights and a tokenizer; memtrain train --hf-model {folder}")
