"""mkdocs hook: references to code in the docs must still point at something.

Two kinds of reference are checked on every page, in inline code only (fenced blocks are examples
and are left alone):

- a dotted name that starts with ``tiertrain.`` (``tiertrain.setup``, ``tiertrain.plan.Budgets``,
  ``tiertrain.runtime``): the longest prefix that imports as a module is imported and the rest is
  looked up with ``getattr``, so a renamed module, class or function is found at build time;
- a repository path that starts with ``src/``, ``tests/`` or ``scripts/``: it must exist.

A reference that does not resolve is logged as a warning, which ``strict: true`` turns into a
failed build. The code checked is the working tree's (``src/`` beside ``mkdocs.yml`` goes first on
``sys.path``), not whatever tiertrain happens to be installed. Modules are imported only when a page
names them, and each name is resolved once per build.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.code_refs")

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_NAME = re.compile(r"(?<![\w./-])tiertrain(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./-])(?:src|tests|scripts)/[\w./-]*[\w/]")

_root = Path.cwd()
_resolved: dict[str, str | None] = {}


def on_config(config, **kwargs):
    """Find the repository (the folder of mkdocs.yml) and put its ``src/`` first on the path."""
    global _root
    _root = Path(config.config_file_path).resolve().parent
    src = str(_root / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    _resolved.clear()
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    where = page.file.src_uri
    for line, code in inline_code(markdown):
        for name in _NAME.findall(code):
            problem = resolve(name)
            if problem:
                log.warning("%s:%d: `%s` does not resolve: %s", where, line, name, problem)
        for path in _PATH.findall(code):
            if not (_root / path).exists():
                log.warning("%s:%d: `%s` does not exist in the repository", where, line, path)
    return markdown


def inline_code(markdown: str):
    """(line number, text) of every inline code span outside fenced code blocks."""
    lines, fence = [], None
    for text in markdown.splitlines():
        m = _FENCE.match(text)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            lines.append("")
        elif fence is not None:
            if m and m.group(1).startswith(fence):
                fence = None
            lines.append("")
        else:
            lines.append(text)
    prose = "\n".join(lines)
    for m in _INLINE.finditer(prose):
        yield prose.count("\n", 0, m.start()) + 1, m.group(2)


def resolve(name: str) -> str | None:
    """None where ``name`` names something; otherwise what is missing."""
    if name not in _resolved:
        _resolved[name] = _resolve(name)
    return _resolved[name]


def _resolve(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                continue  # no such module: try a shorter prefix and getattr the rest
            return f"importing {module} failed: {exc}"
        except Exception as exc:  # noqa: BLE001 - any failure to import is the reference's problem
            return f"importing {module} failed: {type(exc).__name__}: {exc}"
        for k, attr in enumerate(parts[i:], start=i):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                return f"{'.'.join(parts[:k])} has no attribute {attr!r}"
        return None
    return "no module of that name"
