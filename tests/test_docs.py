"""The documentation stays true: the docs build strictly (links, anchors and code references all
resolve), the checks that make it strict can fail, and the README's Python example runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the docs under ``root``, in a process of its own (the hook imports
    tiertrain from ``root/src``)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=120)


def _copy_docs(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied, the code they refer to linked in: a tree to break one thing in."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("src", "tests", "scripts"):
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    return root


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    built = _build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "index.html").is_file()


@pytest.mark.parametrize("breakage", ["link", "code reference"])
def test_docs_build_fails_on_a_broken_reference(tmp_path, breakage):
    pytest.importorskip("mkdocs")
    root = _copy_docs(tmp_path)
    page = root / "docs" / "status.md"
    if breakage == "link":
        line = "\nSee [the missing page](no-such-page.md).\n"
        expect = "no-such-page.md"
    else:
        line = "\nSee `tiertrain.no_such_thing`.\n"
        expect = "tiertrain.no_such_thing"
    page.write_text(page.read_text() + line)
    built = _build(root, tmp_path / "site")
    assert built.returncode != 0, built.stdout + built.stderr
    assert expect in built.stdout + built.stderr


def _first_python_block(text: str) -> str:
    found = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert found, "README.md has no ```python block"
    return found.group(1)


def test_readme_python_quick_start_runs(tmp_path):
    code = _first_python_block(README.read_text())
    assert "tiertrain.Budgets(" in code and "tiertrain.setup(" in code
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    env = {**os.environ, "TIERTRAIN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO / "src")}
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "loss" in ran.stdout, ran.stdout


def test_readme_keeps_the_two_commands():
    text = README.read_text()
    assert "make train" in text
    assert "make test" in text
