"""Text data: a byte tokenizer, a file-split corpus loader and batch iterators."""

from decentral.data.batches import eval_batches, evaluate, shard_bounds, train_batches
from decentral.data.corpus import Corpus, default_corpus_paths, load_corpus
from decentral.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "default_corpus_paths",
    "eval_batches",
    "evaluate",
    "load_corpus",
    "shard_bounds",
    "train_batches",
]
