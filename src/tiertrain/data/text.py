"""Plain text into tokens: byte-level (vocabulary 256) or with a tokenizer the user names."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiertrain.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


def text_files(path: Path) -> list[Path]:
    """The text files to read: the file itself, or every text file under a directory, sorted."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DataError(
            f"directory {path} has no text files ({', '.join(TEXT_SUFFIXES)}); "
            "add some or point --data at a token file"
        )
    return files


def tokenize_bytes(data: bytes) -> np.ndarray:
    """Byte-level tokens: each byte is its own id, so any text works with vocab_size >= 256."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def tokenize_with(tokenizer_path: str, text: str) -> np.ndarray:
    """Tokenize with a Hugging Face tokenizer from a local directory (no hub access)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--tokenizer needs transformers: pip install 'tiertrain[hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"cannot load tokenizer {tokenizer_path!r} ({exc.__class__.__name__}); "
            "give a local directory holding tokenizer files"
        ) from None
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.uint32 if len(tok) > 65535 else np.uint16)


def read_text_tokens(path: Path, tokenizer: str | None) -> np.ndarray:
    files = text_files(path)
    raw = b"\n".join(f.read_bytes() for f in files)
    if not raw.strip():
        raise DataError(f"{path} holds no text; point --data at non-empty data")
    if tokenizer is None:
        return tokenize_bytes(raw)
    return tokenize_with(tokenizer, raw.decode("utf-8", errors="replace"))
