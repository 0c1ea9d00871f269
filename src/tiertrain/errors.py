"""User-facing errors.

Everything a user can cause (bad config, missing data, wrong checkpoint) raises a
subclass of :class:`UserError`. The CLI prints these as one line and exits with
status 2; any other exception is a bug in tiertrain and keeps its traceback.
"""

from __future__ import annotations


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
