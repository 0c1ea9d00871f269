"""The dp x pp x tp layouts ``tiertrain plan --layouts`` compares for N ranks (issue 39, FOLD3D §2.1):
tensor parallel only inside a node (its groups' sums on every block's critical path want the fastest
links), pipeline stages and data-parallel replicas over the rest. Which layout is fastest depends on the
model, the budgets and the links, so each is planned in full and their predictions compared, not ranked
by a rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_TP = 8  # a node's fast links rarely join more GPUs; Megatron's guidance too


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int

    def flags(self) -> str:
        return f"--tp {self.tp} --pp {self.pp}"


def layouts(nproc: int, per_node: int, blocks: int, cuts: Callable[[int], bool]) -> list[Layout]:
    """Every layout of ``nproc`` ranks (``per_node`` a node, 0: one node): a tp dividing a node's ranks
    whose cut the model allows (``cuts``), and a pp dividing the rest that leaves each stage a block."""
    node = per_node or nproc
    out = []
    for tp in (t for t in range(1, min(node, MAX_TP) + 1) if node % t == 0 and cuts(t)):
        rest = nproc // tp
        out += [Layout(tp, pp, rest // pp) for pp in range(1, min(rest, blocks) + 1) if rest % pp == 0]
    return out


def tokens_per_s(layout: Layout, rows: int, seq: int, step_s: float) -> float:
    """What a layout trains a second: each of its replicas takes ``rows`` sequences of ``seq`` tokens a step."""
    return layout.dp * rows * seq / step_s if step_s > 0 else 0.0
