"""Packed rows: full fixed-size rows holding every pair once, and the Hugging Face batch of them."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from memtrain.data.documents import TokenDocuments, stdlib_documents
from memtrain.data.packed_rows import PackedRows, hf_collate, tokenized_rows
from memtrain.errors import ConfigError


@pytest.fixture(scope="module")
def mixed_documents() -> TokenDocuments:
    """Real text of mixed lengths: 1 MiB of the standard library split on blank lines, at most 129 tokens."""
    return stdlib_documents(max_len=129, max_bytes=2**20)


@pytest.fixture(scope="module")
def tokenizer(hf_model_dir):
    from memtrain.hf import load_tokenizer

    return load_tokenizer(hf_model_dir)


def test_packed_rows_are_full_fixed_size_rows_holding_every_pair_once(mixed_documents):
    docs = TokenDocuments(mixed_documents.tokens, mixed_documents.starts[:500], mixed_documents.lengths[:500])
    rows = PackedRows(docs, seq_len=96)
    batches = list(DataLoader(rows, batch_size=8))
    assert all(b.input_ids.shape == b.labels.shape == b.position_ids.shape == (len(b.labels), 96) for b in batches)
    want = sorted((int(a), int(b)) for i in range(len(docs)) for a, b in zip(docs[i][:-1], docs[i][1:], strict=True))
    got = sorted((int(a), int(b)) for batch in batches for xs, ys in zip(batch.input_ids, batch.labels, strict=True)
                 for a, b in zip(xs, ys, strict=True) if b != -100)
    assert got == want
    assert rows.real_tokens == len(want) and rows.padding_fraction < 0.05, rows.padding_fraction
    first = rows[0]  # positions restart at 0 where a document starts (where the previous one ended)
    starts = (first.position_ids == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) >= 1
    with pytest.raises(ConfigError, match="seq_len must be an integer >= 1"):
        PackedRows(docs, seq_len=0)


def test_hf_collate_gives_the_trainer_shifted_labels(tokenizer, tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"value_{i} = {i * i}" for i in range(40)))
    train, val = tokenized_rows(path, tokenizer, seq_len=16, val_fraction=0.1)
    assert len(train) and len(val)
    batch = hf_collate([train[0], train[1]])
    assert set(batch) == {"input_ids", "labels", "shift_labels", "position_ids"}
    assert batch["shift_labels"] is batch["labels"] and batch["input_ids"].shape == (2, 16)
