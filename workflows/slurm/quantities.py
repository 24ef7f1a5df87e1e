"""Counts and Slurm times as users write them (NODES=5, ACCUM=2, --time 1-00:00:00)."""

from __future__ import annotations

import re

from vitpod.workflows.errors import ConfigError

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def whole_number(value: str | int | None, name: str, default: int) -> int:
    """A user's count (NODES=5, ACCUM=2): empty means the default; else a whole number >= 1."""
    if value in (None, ""):
        return default
    try:
        number = int(value)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number; write e.g. {name}=2") from None
    if number < 1:
        raise ConfigError(f"{name}={number}: must be at least 1")
    return number


def count(value: str, name: str) -> int:
    """A whole number >= 0 given on the command line (e.g. --warmup); empty means 0."""
    try:
        number = int(value or 0)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number; write e.g. {name}=5") from None
    if number < 0:
        raise ConfigError(f"{name}={number}: must be 0 or more")
    return number


def slurm_minutes(text: str) -> int:
    """Minutes of a Slurm time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (sbatch --time)."""
    match = _TIME.match(text.strip())
    if not match:
        raise ConfigError(f"{text!r} is not a Slurm time; write HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
        return int(days) * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    if c is not None:  # HH:MM:SS
        return int(a) * 60 + int(b) + (1 if int(c) else 0)
    if b is not None:  # MM:SS
        return int(a) + (1 if int(b) else 0)
    return int(a)
