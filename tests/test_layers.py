"""DESIGN.md's layers hold in the code: import-linter's contracts (pyproject.toml) pass, an upward
import makes them fail, and the planner loads without torch (issue 17)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLANNER_AND_PLAN = ["tiertrain.plan", "tiertrain.plan.bytes", "tiertrain.plan.options", "tiertrain.planner",
                    "tiertrain.planner.auto", "tiertrain.planner.costs", "tiertrain.planner.profile",
                    "tiertrain.planner.simulator", "tiertrain.planner.solvers"]


def _lint(src: Path, cwd: Path) -> subprocess.CompletedProcess:
    """import-linter on the package under ``src``, with the contracts of ``cwd``'s pyproject.toml."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})


def test_the_layer_contracts_are_kept():
    pytest.importorskip("importlinter")
    r = _lint(REPO / "src", REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "3 kept, 0 broken" in r.stdout


@pytest.mark.parametrize("module, upward", [
    ("plan/tiers.py", "import tiertrain.memory.system"),          # the plan layer reaching up to memory
    ("optim/adamw.py", "import tiertrain.runtime.block_group"),    # optim importing the runtime (the old cycle)
    ("planner/costs.py", "import torch"),                          # the planner loading torch
    ("bench/machine.py", "import tiertrain.cli.main"),             # bench importing the CLI
    ("runtime/blocks.py", "import tiertrain.models.moe"),           # the runtime reaching for the model's MoE class
    ("checkpoint/run.py", "import tiertrain.api.setup"),            # checkpoints and the public API are apart
])
def test_an_upward_import_breaks_the_contracts(tmp_path, module, upward):
    pytest.importorskip("importlinter")
    shutil.copytree(REPO / "src" / "tiertrain", tmp_path / "src" / "tiertrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "tiertrain" / module
    target.write_text(target.read_text() + f"\n{upward}  # an upward import\n")
    r = _lint(tmp_path / "src", tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout[-2000:]


def test_importing_the_planner_and_the_plan_loads_no_torch():
    code = ("import sys; import " + ", ".join(PLANNER_AND_PLAN) +
            "; bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'tiertrain.memory', "
            "'tiertrain.runtime', 'tiertrain.models'))); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
