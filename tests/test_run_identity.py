"""The data fingerprint: data of the same length and other contents fingerprint differently, every example of a
list counts, and any tensor, the loss mask and the packing of rows are data."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def _datasets_of_each_kind():
    """Pairs (a, b) of datasets of the same length whose contents differ in one item's one field."""
    from memtrain.data import Document, PackedRow

    def packed(flip: int):
        rows = [PackedRow(torch.arange(8), torch.arange(1, 9), torch.arange(8)) for _ in range(3)]
        labels = rows[1].labels.clone()
        labels[3] = flip
        rows[1] = rows[1]._replace(labels=labels)
        return rows

    def docs(last: int):
        return [Document(torch.tensor([1, 2, 3]), torch.tensor([-100, 2, last])) for _ in range(2)]

    return {
        "PackedRow": (packed(-100), packed(7)),
        "Document": (docs(3), docs(4)),
        "tuples of lists": ([([1, 2, 3], [2, 3, 4])] * 2, [([1, 2, 3], [2, 3, 5]), ([1, 2, 3], [2, 3, 4])]),
        "lists of ints": ([[1, 2], [3, 4]], [[1, 2], [3, 5]]),
        "strings": (["def f(): pass", "x = 1"], ["def f(): pass", "x = 2"]),
        "dicts": ([{"input_ids": [1, 2]}], [{"input_ids": [1, 3]}]),
        "dtype only": ([torch.zeros(4, dtype=torch.int32)], [torch.zeros(4, dtype=torch.float32)]),
        "shape only": ([torch.zeros(2, 3)], [torch.zeros(3, 2)]),
        "numpy": ([np.arange(4)], [np.arange(4) * 2]),
    }


@pytest.mark.parametrize("kind", list(_datasets_of_each_kind()))
def test_data_of_the_same_length_and_other_contents_fingerprint_differently(kind):
    from memtrain.run import data_fingerprint

    a, b = _datasets_of_each_kind()[kind]
    assert len(a) == len(b)
    fa, fb = data_fingerprint(a), data_fingerprint(b)
    assert fa.examples == fb.examples
    assert fa.sha256 != fb.sha256, f"{kind}: two datasets with other contents fingerprint alike: {fa}"
    again = _datasets_of_each_kind()[kind][0]  # equal contents, other objects
    assert data_fingerprint(again) == fa, f"{kind}: equal contents must fingerprint alike"


def test_every_example_of_a_list_counts_not_a_sample():
    from memtrain.run import data_fingerprint

    a = [torch.tensor([i]) for i in range(1000)]
    b = list(a)
    b[1] = torch.tensor([-1])  # not among 256 evenly spaced samples of 1000
    assert data_fingerprint(a).sha256 != data_fingerprint(b).sha256
    assert data_fingerprint(a).of == "every example"


def test_the_fingerprint_takes_bf16_empty_and_zero_d_tensors_and_the_packing_of_rows():
    from memtrain.data import PackedRows, TokenDocuments
    from memtrain.run import data_fingerprint

    items = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 0), torch.tensor(3.0), np.zeros(()), None, 1.5]
    assert data_fingerprint(items).sha256 != data_fingerprint(items[:-1] + [2.5]).sha256
    docs = TokenDocuments.from_texts(["abcd", "xyz", "pq"])
    masked = TokenDocuments(docs.tokens, docs.starts, docs.lengths, loss_mask=np.arange(len(docs.tokens)) % 2 == 0)
    assert data_fingerprint(docs).sha256 != data_fingerprint(masked).sha256, "the loss mask is data"
    rows, other = PackedRows(docs, seq_len=4), PackedRows(docs, seq_len=4, pad_id=7)
    assert len(rows) == len(other) and data_fingerprint(rows).of == "token stream"
    assert data_fingerprint(rows).sha256 != data_fingerprint(other).sha256, "the padding is data"
    assert data_fingerprint(rows) == data_fingerprint(PackedRows(docs, seq_len=4))


@pytest.mark.parametrize(("schedule", "note"), [
    (None, "(the cosine schedule now ends there)"), ("linear", "(the linear schedule now ends there)"),
    ("constant", "(the learning rate stays constant after the warm-up)")])
def test_a_new_max_steps_names_the_runs_own_schedule(schedule, note):
    """A resume that changes max_steps says what that does to the schedule the run uses (it said "cosine" for all)."""
    from memtrain.run.identity import applied_changes

    saved, now = {"max_steps": 2, "lr_schedule": schedule}, {"max_steps": 3, "lr_schedule": schedule}
    assert applied_changes(saved, now) == [f"resume: max_steps=3 applied (the run had max_steps=2) {note}"]


def test_a_resume_on_other_ranks_or_without_fsdp_is_the_same_run_and_another_global_batch_is_not():
    """The checkpoint's state reads onto any number of ranks (FSDP2's shards resharded) and a step's examples are
    the global batch's whatever the ranks: the ranks and FSDP2 may change on resume, the global batch may not."""
    import dataclasses

    from memtrain.run.identity import DataFingerprint, ModelFingerprint, RunIdentity, compare_runs

    run = RunIdentity(seed=0, global_batch_size=32, world_size=2, seq_len=16,
                      data=DataFingerprint(examples=10, sha256="ab", of="token stream"),
                      model=ModelFingerprint(class_name="GPT", shapes={"w": (2, 2)}), precision="fp32",
                      min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0, fsdp=True, lr_schedule="cosine",
                      adam_betas=(0.9, 0.95), adam_eps=1e-8, offload_optimizer=False, optimizer="AdamW")
    assert compare_runs(run, dataclasses.replace(run, world_size=1, fsdp=False)) == []
    assert compare_runs(run, dataclasses.replace(run, world_size=4)) == []
    (problem,) = compare_runs(run, dataclasses.replace(run, world_size=1, fsdp=False, global_batch_size=16))
    assert "global_batch_size=16 now but global_batch_size=32" in problem, problem
