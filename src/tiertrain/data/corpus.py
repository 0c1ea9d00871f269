"""The built-in default corpus: text that is on every machine that runs Python.

We read the Python standard library's own source files (sorted, up to a byte limit):
several megabytes of real, structured text, no download, no file shipped with us.
Its exact bytes depend on the Python version, so runs compare within one machine.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

DEFAULT_CORPUS_BYTES = 8 * 1024 * 1024


def default_corpus(limit: int = DEFAULT_CORPUS_BYTES) -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"\n".join(parts)[:limit]
