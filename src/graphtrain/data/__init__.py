"""Embedded default data: the Python standard library's source, a locally trained byte-level BPE,
and deterministic batch sources for GPT-2 (next token) and BERT (masked tokens).

    from graphtrain.data import build_data
    data = build_data(config, family=model.family)
    batch = data.train.get_batch(step, batch_size)   # same (seed, split, step) -> same batch
    loss = model(**batch)
"""

from graphtrain.data.corpus import Corpus, default_root, list_files, load_corpus, split_documents
from graphtrain.data.loaders import IGNORE_INDEX, BatchSource, DataBundle, build_data
from graphtrain.data.tokenizer import SPECIAL_TOKENS, CodeTokenizer, cache_root, load_or_build, train_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "SPECIAL_TOKENS",
    "BatchSource",
    "CodeTokenizer",
    "Corpus",
    "DataBundle",
    "build_data",
    "cache_root",
    "default_root",
    "list_files",
    "load_corpus",
    "load_or_build",
    "split_documents",
    "train_tokenizer",
]
