"""Shared fixtures: a tiny pretrained Hugging Face folder (a Llama and its own fast tokenizer), built offline.

``hf_model_dir`` is what a user's local checkpoint looks like: ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``tokenizer_config.json``. The tokenizer is a byte-level BPE trained with the
``tokenizers`` library on the built-in corpus (the standard library's source); the Llama is random but saved
with ``save_pretrained``, so loading it goes through the same code as a downloaded model. Built once per session
in about a second. The builders live in ``helpers``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import build_llama, build_tokenizer, planner_llama


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory) -> Path:
    """A local pretrained folder: a tiny Llama in safetensors plus the fast tokenizer it was built for."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer(directory)
    build_llama(directory, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    return directory


@pytest.fixture(scope="module")
def llama():
    """The planner tests' Llama config (``helpers.planner_llama``)."""
    return planner_llama()

