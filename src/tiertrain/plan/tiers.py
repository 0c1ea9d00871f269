"""The names of where bytes live and of what they are."""

from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class Kind(str, Enum):
    """State kinds, as accounted per tier (ANGEL-PTM Table 1's columns, split finer)."""

    PARAM = "param"            # compute parameters
    MASTER = "master"          # fp32 master copy
    EXP_AVG = "exp_avg"        # Adam first moment
    EXP_AVG_SQ = "exp_avg_sq"  # Adam second moment
    GRAD = "grad"
    REDUCE = "reduce"          # data parallel: a micro-batch's gradients on their way over the ranks (stage, part)
    ACTIVATION = "activation"
    OTHER = "other"
