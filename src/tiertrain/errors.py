"""User-facing errors.

Everything a user can cause (bad config, missing data, wrong checkpoint) raises a
subclass of :class:`UserError`. The CLI prints these as one line and exits with
status 2; any other exception is a bug in tiertrain and keeps its traceback.
"""

from __future__ import annotations


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A library's message on one line (an ``error:`` line must stay one line), cut at ``limit``."""
    return (" ".join(str(exc).split()) or type(exc).__name__)[:limit]


class UserError(Exception):
    """A problem with what the user asked for; the message names it and the fix."""

    exit_code: int = 2


class ConfigError(UserError):
    """A config file, flag or model name that cannot be used."""


class DataError(UserError):
    """Training data that is missing, empty, too short or malformed."""


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, or from a different model."""


class OutputError(UserError):
    """An output directory that cannot be written."""


class BudgetError(UserError):
    """An allocation that would take a tier past the budget the user gave it."""

    def __init__(self, tier: str, needed: int, budget: int, in_use: int, detail: str = "") -> None:
        from tiertrain.units import format_bytes

        self.tier, self.needed, self.budget, self.in_use = tier, needed, budget, in_use
        if detail:
            super().__init__(f"{tier} tier cannot reserve {format_bytes(needed)}: {detail}; lower the {tier} budget")
            return
        super().__init__(
            f"{tier} tier cannot hold {format_bytes(needed)} more: budget {format_bytes(budget)}, "
            f"{format_bytes(in_use)} in use; raise the {tier} budget or place these states elsewhere"
        )


class DiskError(UserError):
    """A disk-tier read or write that failed or returned wrong data; never silent."""
