"""Data: the built-in corpus, document datasets, collation, length bucketing, validated loaders and a device
prefetcher. Tokens live in numpy arrays, which DataLoader workers share instead of copying on access.

Read in this order:
    corpus       the built-in corpus (the standard library's source, byte tokens) and fixed windows of it
    documents    variable-length documents (one token array, a start and a length each); .txt/.jsonl readers
    token_cache  a file tokenised once by a model's tokenizer, cached beside the data
    packed_rows  documents packed once into rows of seq_len positions (and the Hugging Face batch of them)
    collate      a batch of documents padded to its longest (PadCollate) or packed into rows (PackCollate)
    buckets      LengthBucketSampler: batches of similar lengths, the costliest first, dealt out to the ranks
    loader       make_loader: worker, pinning and prefetch settings checked against the machine, with reasons
    prefetch     DevicePrefetcher: the host->device copy of the next batch hidden behind compute
    step_batches StepBatches: the examples of each optimizer step, from (seed, step) alone (exact resume)
"""

from memtrain.data.buckets import LengthBucketSampler
from memtrain.data.collate import PackCollate, PackedBatch, PadCollate, TokenBatch
from memtrain.data.corpus import (
    ByteWindows,
    builtin_corpus,
    split_windows,
    stdlib_corpus,
    stdlib_source_files,
    text_file_tokens,
)
from memtrain.data.documents import Document, TokenDocuments, stdlib_documents
from memtrain.data.loader import LoaderSettings, Machine, make_loader, resolve_loader_settings
from memtrain.data.packed_rows import PackedRow, PackedRows, hf_collate, tokenized_rows
from memtrain.data.prefetch import DevicePrefetcher, map_tensors
from memtrain.data.step_batches import StepBatches
from memtrain.data.token_cache import token_cache_path, tokenize_file

__all__ = [
    "ByteWindows",
    "DevicePrefetcher",
    "Document",
    "LengthBucketSampler",
    "LoaderSettings",
    "Machine",
    "PackCollate",
    "PackedBatch",
    "PackedRow",
    "PackedRows",
    "PadCollate",
    "StepBatches",
    "TokenBatch",
    "TokenDocuments",
    "builtin_corpus",
    "hf_collate",
    "make_loader",
    "map_tensors",
    "resolve_loader_settings",
    "split_windows",
    "stdlib_corpus",
    "stdlib_documents",
    "stdlib_source_files",
    "text_file_tokens",
    "token_cache_path",
    "tokenize_file",
    "tokenized_rows",
]
