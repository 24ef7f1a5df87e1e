"""Slurm --time strings -> minutes (preflight's time-limit check, the local executor's timeout).

Every form of sbatch(1) --time; the issue: "2-12" (2 days 12 hours) was read as 2892 minutes.
"""

from __future__ import annotations

import pytest

from vitpod.workflows.errors import ConfigError
from vitpod.workflows.slurm.quantities import slurm_minutes


@pytest.mark.parametrize(
    ("slurm_time", "minutes"),
    [
        ("90", 90),  # minutes
        ("90:30", 91),  # minutes:seconds (a started minute counts: never cut a job short)
        ("90:00", 90),
        ("2:03:00", 123),  # hours:minutes:seconds
        ("2:03:01", 124),
        ("2-12", 3600),  # days-hours: the case, 2 days 12 hours (was 2892)
        ("2-12:30", 3630),  # days-hours:minutes
        ("2-12:30:00", 3630),  # days-hours:minutes:seconds
        ("0-00:00:30", 1),
    ],
)
def test_every_slurm_time_form(slurm_time: str, minutes: int) -> None:
    assert slurm_minutes(slurm_time) == minutes


def test_too_many_fields_is_an_error_naming_the_form() -> None:
    with pytest.raises(ConfigError, match=r"'1:2:3:4' is not a Slurm time; write HH:MM:SS"):
        slurm_minutes("1:2:3:4")
