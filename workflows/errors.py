"""The one user-facing error type for bad profiles, recipes and overrides."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input; the message names the field and the fix. The CLI exits with status 2."""
