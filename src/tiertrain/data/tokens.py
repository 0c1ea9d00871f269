"""Token arrays: pre-tokenized files read through a memmap, and validation of any token array.

Token files follow the nanoGPT/Megatron convention: a flat binary of little-endian
unsigned integers with no header. ``*.bin`` is uint16; ``*.u32.bin`` / ``*.uint32.bin``
is uint32. ``*.npy`` files carry their own dtype (loaded with allow_pickle=False).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiertrain.errors import DataError

TOKEN_SUFFIXES = (".bin", ".npy")


def is_token_file(path: Path) -> bool:
    return path.suffix in TOKEN_SUFFIXES


def open_token_file(path: Path) -> np.ndarray:
    """Memory-map a token file without reading it."""
    if path.stat().st_size == 0:
        raise DataError(f"token file {path} is empty; point --data at a file with tokens in it")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise DataError(f"cannot read {path} as a token array: {exc}") from None
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise DataError(f"{path} must hold a 1-D integer array, got {arr.dtype} {arr.shape}")
        return arr
    name = path.name.lower()
    dtype = np.uint32 if name.endswith((".u32.bin", ".uint32.bin")) else np.uint16
    itemsize = np.dtype(dtype).itemsize
    if path.stat().st_size % itemsize:
        raise DataError(
            f"{path} has {path.stat().st_size} bytes, not a whole number of {np.dtype(dtype).name} "
            "tokens; name uint32 files *.u32.bin"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def check_tokens(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Refuse token ids the model cannot embed, naming the largest one found."""
    if len(tokens) == 0:
        raise DataError(f"{source} holds no tokens; point --data at non-empty data")
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(
            f"{source} holds token id {top} but the model's vocabulary has {vocab_size} entries; "
            "use a model with a larger vocab_size or the tokenizer the data was made with"
        )
