"""Training data: token files, text files or directories, and the built-in default corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiertrain.data.corpus import default_corpus
from tiertrain.data.sampler import BatchSampler
from tiertrain.data.text import read_text_tokens, tokenize_bytes
from tiertrain.data.tokens import check_tokens, is_token_file, open_token_file
from tiertrain.errors import DataError

__all__ = ["BatchSampler", "load_tokens"]

DEFAULT_DATA = "builtin"


def load_tokens(data: str | None, vocab_size: int, tokenizer: str | None = None) -> np.ndarray:
    """Resolve ``--data`` into a 1-D token array and check it against the vocabulary.

    ``None`` or ``"builtin"``: the default corpus, byte-level. A ``.bin``/``.npy`` file:
    pre-tokenized, memory-mapped. Anything else: a text file or a directory of them.
    """
    if data in (None, DEFAULT_DATA):
        tokens, source = tokenize_bytes(default_corpus()), "the built-in corpus"
    else:
        path = Path(data)
        if not path.exists():
            raise DataError(f"data path {path} does not exist; give a token file, a text file or a directory")
        source = str(path)
        if path.is_file() and is_token_file(path):
            tokens = open_token_file(path)
        else:
            if path.is_file() and path.stat().st_size == 0:
                raise DataError(f"data file {path} is empty; point --data at a file with text in it")
            tokens = read_text_tokens(path, tokenizer)
    check_tokens(tokens, vocab_size, source)
    return tokens
