"""A profile measured on one machine, carried to another by its description (FOLD3D's performance
model in spirit: compute from FLOPs and bytes at the target's rates).

Each block's times are scaled by the ratio of its roofline time there to its roofline time here
(``machine.compute_seconds`` from the block's forward FLOPs, weight bytes and element-wise traffic).
The assumption, stated: a block reaches the same fraction of its roofline on both machines, so what
the measurement here learnt beyond FLOPs and bytes (kernel efficiency at this shape, overheads)
carries over. A block without recorded work (a profile file from before) is scaled by the ratio of
the matmul rates alone. Links, disk and the CPU optimizer are the target's as described. Planning
"for" the machine the profile was measured on changes nothing: the ratio is one.
"""

from __future__ import annotations

import dataclasses

from tiertrain.planner.machine import Machine, compute_seconds
from tiertrain.planner.profile import BlockProfile, Profile
from tiertrain.precisions import BYTES


def block_ratio(b: BlockProfile, dtype: str, here: Machine, there: Machine) -> float:
    """How much longer ``b`` computes there than here."""
    if b.flops <= 0:
        return here.matmul(dtype) / there.matmul(dtype)
    weights = b.params * BYTES[dtype]
    return (compute_seconds(b.flops, weights, b.traffic_bytes, there, dtype)
            / compute_seconds(b.flops, weights, b.traffic_bytes, here, dtype))


def slowed(p: Profile, k: float) -> Profile:
    """``p`` with every block computing ``k`` times as long (other processes taking the cores it computes on)."""
    return dataclasses.replace(p, blocks=tuple(b.computing(k) for b in p.blocks), rest=p.rest.computing(k))


def for_machine(p: Profile, here: Machine, there: Machine) -> Profile:
    """``p`` (measured or estimated at ``here``'s rates) as it would run on ``there`` (the same machine
    whatever either says of its disk's gain for reads and writes at once: no block's compute depends on it)."""
    if dataclasses.replace(here, disk_together_gain=there.disk_together_gain) == there:
        return dataclasses.replace(p, machine=there.rates())
    dtype = p.compute_dtype
    blocks = tuple(b.computing(block_ratio(b, dtype, here, there)) for b in p.blocks)
    rest = p.rest.computing(block_ratio(p.rest, dtype, here, there))
    note = (f"; compute carried from {here.name} to {there.name} by FLOPs and bytes at its rates "
            f"(assumes each block reaches the same fraction of its roofline there)")
    return dataclasses.replace(p, blocks=blocks, rest=rest, machine=there.rates(), source=p.source + note)
