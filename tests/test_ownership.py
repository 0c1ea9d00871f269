"""One owner per decision, read off the code's syntax as the layer contracts are (issue 35): only
``runtime/block_group.py`` assigns a block group's fields; only the update modes tell the modes apart;
only ``plan/fit.py`` holds anything against a budget. Each rule is checked on the tree as it is, and
on a copy with the rule broken once, which must fail."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tiertrain"
GROUP = Path("runtime/block_group.py")
MODES = Path("runtime/modes")
MODE_RULES = Path("plan/update_modes.py")
UPDATE_MODES = {"sync", "overlap", "lockfree"}


def group_fields(src: Path) -> set[str]:
    """Every name a ``BlockGroup`` holds: what its methods assign on ``self``, and its properties."""
    tree = ast.parse((src / GROUP).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockGroup")
    names = set()
    for node in ast.walk(cls):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    for node in cls.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", None) == "property":
            names |= {t.id for t in _targets(node) if isinstance(t, ast.Name)}
        if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "property" for d in node.decorator_list):
            names.add(node.name)
    return names


def _targets(node: ast.AST) -> list[ast.AST]:
    """The assignment targets of ``node``, tuples unpacked and subscripts reduced to what they index."""
    if isinstance(node, ast.Assign):
        raw = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        raw = [node.target]
    else:
        return []
    out = []
    while raw:
        t = raw.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            raw += t.elts
        elif isinstance(t, ast.Subscript):
            raw.append(t.value)
        else:
            out.append(t)
    return out


def group_field_writes(src: Path) -> list[str]:
    """``file:line name`` of every assignment to a block group's field outside its module: one of its
    private fields set on anything but ``self``, or any of its names through ``setattr``. (Its public
    names are read-only properties, which ``test_a_groups_public_names_cannot_be_assigned`` holds; an
    attribute named like one of them on another object, a block's ``params``, is no group's.)"""
    fields = group_fields(src)
    private = {f for f in fields if f.startswith("_")}
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel == GROUP:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and t.attr in private and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append(f"{rel}:{node.lineno} {t.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                    "setattr", "__setattr__") and any(isinstance(a, ast.Constant) and a.value in fields
                                                      for a in node.args):
                found.append(f"{rel}:{node.lineno} setattr")
    return found


def mode_tests(src: Path, under: tuple[str, ...]) -> list[str]:
    """``file:line`` of every comparison that tells the update modes apart (an ``update`` attribute or
    name, or a mode's name, compared) in the packages ``under``, outside the runtime's modes and the
    plan layer's rules for them (``plan/update_modes.py``)."""
    found = []
    for pkg in under:
        for path in sorted((src / pkg).rglob("*.py")):
            rel = path.relative_to(src)
            if rel.is_relative_to(MODES) or rel == MODE_RULES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
                if any(_tells_modes(x) for x in sides) and not any(
                        isinstance(x, ast.Constant) and x.value is None for x in sides):  # given or not: no mode
                    found.append(f"{rel}:{node.lineno}")
    return found


def _tells_modes(x: ast.AST) -> bool:
    if isinstance(x, ast.Attribute) and x.attr == "update" or isinstance(x, ast.Name) and x.id == "update":
        return True
    consts = x.elts if isinstance(x, (ast.Tuple, ast.List, ast.Set)) else [x]
    return any(isinstance(c, ast.Constant) and c.value in UPDATE_MODES for c in consts)


EVERYWHERE = ("",)
FIT = Path("plan/fit.py")
# what may compare against a budget besides plan/fit.py: the pools, which enforce their budgets as they hand
# out pages, and the solvers' own search estimates (every plan they return is resolved by plan.fit before
# it is simulated or run: planner.auto.resolved)
ENFORCERS = {Path("memory/pool.py"), Path("memory/movement.py"), Path("planner/solvers.py"), Path("planner/costs.py")}
_BUDGETISH = re.compile(r"budget|memory\b|^pb$|^have$|room|capacity|limit|peaks", re.I)


def budget_comparisons(src: Path) -> list[str]:
    """``file:line`` of every comparison of sizes (<, <=, >, >=) with a budget, a pool's capacity or a
    simulated peak as one side, outside ``plan/fit.py`` and the enforcers: whether something fits is
    decided in one module."""
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel == FIT or rel in ENFORCERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare) or not any(isinstance(o, (ast.Lt, ast.LtE, ast.Gt, ast.GtE))
                                                            for o in node.ops):
                continue
            sides = (node.left, *node.comparators)
            if any(isinstance(s, ast.Constant) and s.value == 0 for s in sides):
                continue  # "is there a disk at all", not a fit
            if any(_budgety(s) for s in sides):
                found.append(f"{rel}:{node.lineno}")
    return found


def _budgety(x: ast.AST) -> bool:
    if isinstance(x, ast.Attribute) and x.attr in ("device", "host", "disk"):
        return bool(_BUDGETISH.search(ast.unparse(x.value)))
    if isinstance(x, ast.Attribute) and x.attr == "capacity":
        return True
    if isinstance(x, ast.Subscript):
        return bool(_BUDGETISH.search(ast.unparse(x.value)))
    if isinstance(x, ast.Name):
        return bool(re.search("budget", x.id, re.I))
    if isinstance(x, ast.Call):
        return bool(re.search("capacity", ast.unparse(x.func)))
    return False


def test_only_the_block_group_assigns_its_fields():
    assert "_grads" in group_fields(SRC) and "version" in group_fields(SRC)
    assert group_field_writes(SRC) == []


def test_a_groups_public_names_cannot_be_assigned(tmp_path):
    from tiered_harness import TINY4, _fresh

    import tiertrain
    from tiertrain.memory import Budgets

    model, opt = _fresh(TINY4)
    tm, _ = tiertrain.setup(model, opt, Budgets(8 << 20, 64 << 20), plan="stream", page_size=64 << 10)
    try:
        g = tm.runtime.groups[0]
        public = sorted(f for f in group_fields(SRC) if not f.startswith("_"))
        assert {"plan", "slot", "version", "params", "state"} <= set(public)
        for name in public:
            with pytest.raises(AttributeError):
                setattr(g, name, getattr(g, name))
    finally:
        tm.runtime.close()
        tm.runtime.mem.close()


def test_nothing_tells_the_update_modes_apart_but_the_modes_and_their_rules():
    assert mode_tests(SRC, EVERYWHERE) == []


def test_only_the_fit_module_holds_anything_against_a_budget():
    assert budget_comparisons(SRC) == []


@pytest.mark.parametrize("module, line, rule", [
    ("runtime/replan.py", "def _broken(need, pool):\n    return need > pool.capacity\n", "fit"),
    ("api/setup.py", "def _broken(need, memory):\n    return need[Tier.HOST] <= memory.host\n", "fit"),
    ("planner/auto.py", "def _broken(sim, pb):\n    return sim.peaks['device'] <= pb.device\n", "fit"),
    ("autoplan/first_step.py", "def _broken(need, budgets):\n    return need <= budgets[Tier.DISK]\n", "fit"),
    ("runtime/cache.py", "def _broken(st):\n    st._version = 3\n", "group"),
    ("runtime/pieces.py", "def _broken(g):\n    g._steps[:] = []\n", "group"),
    ("runtime/state_moves.py", "def _broken(g):\n    g._update, x = None, 1\n", "group"),
    ("checkpoint/run.py", "def _broken(g):\n    setattr(g, '_slot', None)\n", "group"),
    ("train/loop.py", "def _broken(rt):\n    return rt.plan.update == 'lockfree'\n", "modes"),
    ("runtime/runtime.py", "def _broken(update):\n    return update in ('sync', 'overlap')\n", "modes"),
    ("planner/simulator.py", "def _broken(plan):\n    return plan.update != 'sync'\n", "modes"),
])
def test_a_copy_that_breaks_a_rule_fails(tmp_path, module, line, rule):
    copy = tmp_path / "tiertrain"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text() + "\n\n" + line)
    found = {"group": group_field_writes, "modes": lambda src: mode_tests(src, EVERYWHERE),
             "fit": budget_comparisons}[rule](copy)
    assert [f for f in found if f.startswith(module)], found
