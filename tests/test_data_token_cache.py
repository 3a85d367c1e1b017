"""Tokenised text (a model folder's tokenizer: tests/conftest.py builds one): documents with an EOS, the loss on
completions only, bad lines all named, the cache keyed by the file and the tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from memtrain.data.documents import Document
from memtrain.data.packed_rows import PackedRows
from memtrain.data.token_cache import token_cache_path, tokenize_file
from memtrain.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer(hf_model_dir):
    from memtrain.hf import load_tokenizer

    return load_tokenizer(hf_model_dir)


def write_jsonl(path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_a_text_file_is_tokenised_per_blank_line_document_with_an_eos(tmp_path, tokenizer):
    path = tmp_path / "docs.txt"
    path.write_text("def f(x):\n    return x\n\n\n  \nclass A:\n    pass\n")
    docs = tokenize_file(path, tokenizer)
    assert len(docs) == 2 and docs.loss_mask is None and docs.tokens.dtype == np.int32
    eos = tokenizer.eos_token_id
    assert docs[0].tolist() == tokenizer.encode("def f(x):\n    return x") + [eos]
    assert docs[1].tolist() == tokenizer.encode("class A:\n    pass\n") + [eos]


def test_prompt_completion_records_put_the_loss_on_the_completion_only(tmp_path, tokenizer, hf_model_dir):
    """The model's loss on packed rows equals the cross-entropy over exactly the completions' tokens (and their
    EOS): prompt positions carry label -100 and count nowhere, not in the loss nor in its divisor."""
    from memtrain.hf import load_pretrained

    records = [{"prompt": "Q: what is os.path?\nA:", "completion": " a module"},
               {"text": "import sys\n"},
               {"prompt": "def add(a, b):\n", "completion": "    return a + b\n"}]
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, records)
    docs = tokenize_file(path, tokenizer)
    first = docs[0]
    assert isinstance(first, Document)
    prompt, completion = tokenizer.encode(records[0]["prompt"]), tokenizer.encode(records[0]["completion"])
    assert first.tokens.tolist() == prompt + completion + [tokenizer.eos_token_id]
    assert first.labels.tolist() == [-100] * len(prompt) + completion + [tokenizer.eos_token_id]
    assert (docs[1].labels == docs[1].tokens).all()  # a "text" record: the loss on every token
    rows = PackedRows(docs, seq_len=64)
    x, y, positions = (torch.stack(t) for t in zip(*[rows[i] for i in range(len(rows))], strict=True))
    completions = sum(len(tokenizer.encode(r.get("completion", r.get("text")))) + 1 for r in records)
    # every completion token and EOS is a target; so is every token of the "text" record but its first
    assert int((y != -100).sum()) == rows.real_tokens == completions - 1
    model = load_pretrained(hf_model_dir)
    with torch.no_grad():
        loss = model(input_ids=x, labels=y, shift_labels=y, position_ids=positions).loss
        logits = model(input_ids=x, position_ids=positions).logits
    keep = y != -100
    want = torch.nn.functional.cross_entropy(logits[keep].float(), y[keep])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)


def test_bad_jsonl_lines_are_all_reported_with_their_numbers(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [{"text": "fine"}, '{"text": "no end', {"prompt": "p"}, "", {"txt": "typo"},
                       {"text": 3}, "[1, 2]", {"prompt": "p", "completion": None}])
    with pytest.raises(ConfigError) as e:
        tokenize_file(path, tokenizer)
    message = str(e.value)
    assert "6 bad line(s)" in message and len(e.value.problems) == 1, message
    for needle in ("line 2: not valid JSON", 'line 3: "completion" is missing', 'line 5: "text" is missing',
                   'line 6: "text" is int, not a string', "line 7: a JSON list, not an object",
                   'line 8: "completion" is NoneType, not a string'):
        assert needle in message, (needle, message)
    assert not list(tmp_path.glob(".*.npz"))  # nothing cached


def test_tokenised_data_is_cached_by_the_file_and_the_tokenizer(tmp_path, tokenizer):
    class Counting:
        """The tokenizer, counting its calls."""

        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return self.inner(*args, **kwargs)

    path = tmp_path / "docs.txt"
    path.write_text("a = 1\n\nb = 2\n")
    counting = Counting(tokenizer)
    first = tokenize_file(path, counting)
    cache = token_cache_path(path, tokenizer)
    assert cache.is_file() and cache.parent == tmp_path and counting.calls == 1
    again = tokenize_file(path, counting)
    assert counting.calls == 1 and np.array_equal(again.tokens, first.tokens)  # read from the cache
    path.write_text("a = 1\n\nb = 3\n")  # an edit: another key
    assert token_cache_path(path, tokenizer) != cache
    tokenize_file(path, counting)
    assert counting.calls == 2
    elsewhere = tmp_path / "cache"
    tokenize_file(path, counting, cache_dir=elsewhere)
    assert len(list(elsewhere.glob("*.npz"))) == 1


def test_a_large_file_shows_a_progress_bar(tmp_path, tokenizer, capsys):
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"x{i} = {i}" for i in range(50)))
    tokenize_file(path, tokenizer, batch_size=10, progress=True)
    assert "tokenising docs.txt" in capsys.readouterr().err
