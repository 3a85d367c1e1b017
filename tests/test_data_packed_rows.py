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


def _start_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("memtrain train:"))


def test_with_eval_data_all_of_data_trains_and_a_resume_keeps_the_split(tmp_path, capsys):
    """--eval-data is the held-out set: every window of --data trains (none of its last 5% held out), the start-up
    line states both row counts, and a resume trains on the rows of the run it continues whatever --eval-data says."""
    from memtrain.cli import main

    data, held = tmp_path / "train.txt", tmp_path / "held.txt"
    data.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))  # 6,090 bytes
    held.write_text("".join(f"def g{i}(y):\n    return y - {i}\n" for i in range(40)))
    every_window = (len(data.read_bytes()) - 1) // 32
    flags = ["--model", "gpt-tiny", "--data", str(data), "--seq-len", "32", "--max-steps", "1", "--no-progress"]
    assert main(["train", *flags, "--eval-data", str(held), "--out", str(tmp_path / "with")]) == 0
    line = _start_line("".join(capsys.readouterr()))
    assert f"({every_window} training rows, {(len(held.read_bytes()) - 1) // 32} eval rows)" in line, line
    # Without --eval-data the last 5% of --data is held out.
    assert main(["train", *flags, "--out", str(tmp_path / "without")]) == 0
    line = _start_line("".join(capsys.readouterr()))
    held_out = every_window - int(len(data.read_bytes()) * 0.95) // 32
    assert f"({every_window - held_out} training rows, " in line and held_out > 0, line
    # Resumed, each run trains on its own rows: --eval-data given to a resume does not change the split.
    assert main(["train", "--out", str(tmp_path / "with"), "--resume", "--max-steps", "2", "--no-progress"]) == 0
    assert f"({every_window} training rows, " in _start_line("".join(capsys.readouterr()))
    assert main(["train", "--out", str(tmp_path / "without"), "--resume", "--max-steps", "2", "--no-progress",
                 "--eval-data", str(held)]) == 0
    assert f"({every_window - held_out} training rows, " in _start_line("".join(capsys.readouterr()))


def test_with_eval_data_every_document_of_a_tokenised_data_file_trains(tmp_path, hf_model_dir, tokenizer, capsys):
    from memtrain.cli import main
    from memtrain.data.packed_rows import file_rows

    data, held = tmp_path / "docs.jsonl", tmp_path / "held.jsonl"
    data.write_text("".join(f'{{"text": "def f{i}(x):\\n    return x + {i}"}}\n' for i in range(80)))
    held.write_text("".join(f'{{"text": "def g{i}(y):\\n    return y - {i}"}}\n' for i in range(20)))
    every_row = len(file_rows(data, tokenizer, 32))
    assert every_row > len(tokenized_rows(data, tokenizer, 32)[0])
    assert main(["train", "--hf-model", str(hf_model_dir), "--data", str(data), "--eval-data", str(held),
                 "--seq-len", "32", "--global-batch-size", "2", "--max-steps", "1", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    line = _start_line("".join(capsys.readouterr()))
    assert f"({every_row} training rows, {len(file_rows(held, tokenizer, 32))} eval rows)" in line, line
