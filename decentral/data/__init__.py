"""Text data: a byte tokenizer, a file-split corpus loader, named domains and batch iterators."""

from decentral.data.batches import eval_batches, evaluate, shard_bounds, train_batches
from decentral.data.corpus import Corpus, DataError, Document, default_corpus_paths, join_documents, load_corpus, load_documents
from decentral.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "Document",
    "default_corpus_paths",
    "eval_batches",
    "evaluate",
    "join_documents",
    "load_corpus",
    "load_documents",
    "shard_bounds",
    "train_batches",
]
