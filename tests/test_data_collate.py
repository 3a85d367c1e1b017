"""Collation: padding keeps each document's loss; packing holds every pair once, pads far less, and with segments
gives the loss and gradients of the documents padded."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_gpt

from memtrain.data.collate import PackCollate, PackedBatch, PadCollate
from memtrain.data.documents import Document, TokenDocuments, stdlib_documents
from memtrain.errors import ConfigError


@pytest.fixture(scope="module")
def mixed_documents() -> TokenDocuments:
    """Real text of mixed lengths: 1 MiB of the standard library split on blank lines, at most 129 tokens."""
    return stdlib_documents(max_len=129, max_bytes=2**20)


def pairs_of(batch) -> list[tuple[int, int]]:
    """Every real (input, target) pair of a batch, sorted."""
    real = batch.y != -100
    return sorted(zip(batch.x[real].tolist(), batch.y[real].tolist(), strict=True))


def test_padded_batch_gives_the_same_loss_as_each_document_alone():
    model = tiny_gpt(seq_len=64, seed=0).eval()  # the "gpt-tiny" preset
    docs = TokenDocuments.from_texts(["def f(x):\n    return x\n", "a = 1\n", "class A:\n    pass\n\n# end"])
    batch = PadCollate()([docs[i] for i in range(len(docs))])
    assert batch.real_tokens == int((docs.lengths - 1).sum()) and 0 < batch.padding_fraction < 1
    with torch.no_grad():
        padded = model(batch.x, batch.y, reduction="sum")
        alone = sum(model(d[None, :-1], d[None, 1:], reduction="sum") for d in (docs[i] for i in range(len(docs))))
        unmasked = model(batch.x, torch.where(batch.y == -100, 0, batch.y), reduction="sum")
    assert torch.allclose(padded, alone, rtol=1e-5), (padded.item(), alone.item())
    assert not torch.allclose(unmasked, alone, rtol=1e-3), "padding must be excluded from the loss"


def test_packing_holds_every_pair_once_and_pads_far_less_than_padding(mixed_documents):
    docs = [mixed_documents[i] for i in range(400)]
    padded, packed = PadCollate()(docs), PackCollate(seq_len=128)(docs)
    assert isinstance(packed, PackedBatch) and packed.x.shape[1] == 128
    assert packed.real_tokens == padded.real_tokens == sum(len(d) - 1 for d in docs)
    assert pairs_of(packed) == pairs_of(padded)
    print(f"padding fraction: padded to the longest {padded.padding_fraction:.1%}, packed {packed.padding_fraction:.1%}")
    assert packed.padding_fraction < 0.05 < padded.padding_fraction
    # positions restart at every document, and each row's segments run 0, 1, 2, ... in order
    starts = torch.ones_like(packed.segments, dtype=torch.bool)
    starts[:, 1:] = packed.segments[:, 1:] != packed.segments[:, :-1]
    assert torch.equal(packed.positions == 0, starts)
    assert bool((packed.segments.diff(dim=1) >= 0).all())


def test_a_document_longer_than_a_row_is_cut_into_row_sized_pieces():
    batch = PackCollate(seq_len=4)([torch.arange(1, 11)])  # 9 pairs: pieces of 4, 4 and 1
    assert batch.real_tokens == 9 and batch.x.shape == (3, 4)
    assert pairs_of(batch) == [(i, i + 1) for i in range(1, 10)]


def test_packed_rows_give_the_loss_and_gradients_of_the_documents_padded():
    """With segments, attention stays inside each document: packing changes the layout, not the result."""
    texts = ["def f(x):\n    return x\n", "a = 1\n", "class A:\n    pass\n\n# end", "import os\nos.sep\n",
             "x = [i * i for i in range(10)]\n"]
    docs = TokenDocuments.from_texts(texts)
    examples = [docs[i] for i in range(len(docs))]
    padded, packed = PadCollate()(examples), PackCollate(seq_len=64)(examples)
    assert packed.x.shape[0] < padded.x.shape[0]

    def loss_and_grads(batch, **kwargs):
        model = tiny_gpt(seq_len=64, seed=0)
        loss = model(batch.x, batch.y, reduction="sum", **kwargs)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads(padded)
    got, got_grads = loss_and_grads(packed, segments=packed.segments)
    assert torch.allclose(got, want, rtol=1e-5), (got.item(), want.item())
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=1e-4, atol=1e-6), name
    # Control: without segments a document attends to the ones packed before it, and the loss changes.
    leaky, _ = loss_and_grads(packed)
    assert not torch.allclose(leaky, want, rtol=1e-3)


def test_packing_bad_input_is_a_config_error():
    with pytest.raises(ConfigError, match="seq_len must be an integer >= 1"):
        PackCollate(seq_len=0)
    with pytest.raises(ConfigError, match="each needs >= 2 tokens"):
        PackCollate(seq_len=8)([torch.tensor([1])])
    batch = PackCollate(seq_len=8)([torch.tensor([1, 2, 3])])
    with pytest.raises(ConfigError, match="segments of shape"):
        tiny_gpt(seq_len=64)(batch.x, segments=batch.segments[:, :4])


def test_pad_collate_masks_a_documents_prompt_for_length_bucketing():
    doc = Document(torch.tensor([5, 6, 7, 8]), torch.tensor([-100, -100, 7, 8]))
    batch = PadCollate()([doc, torch.tensor([1, 2])])
    assert batch.y.tolist() == [[-100, 7, 8], [2, -100, -100]] and batch.real_tokens == 3
    assert PackCollate(seq_len=4)([doc]).y.tolist() == [[-100, 7, 8, -100]]
