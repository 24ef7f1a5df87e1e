"""A profile's `storage:` block: the shared paths every node sees (data, code, runs)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from vitpod.registry.io import unknown_key_message
from vitpod.workflows.site.profile_container import UNSAFE_PATH
from vitpod.workflows.site.schema import Strict

# Keys older profiles had; a run directory (storage.runs/<run>) holds its checkpoints and results.
REMOVED_STORAGE_KEYS = ("checkpoints", "results")


class Storage(Strict):
    """Shared-storage paths seen by every node; relative ones are relative to the repository.

    A run is one directory under `runs` holding everything it writes (script, logs,
    checkpoints, reports), so `runs` is the path that must be on the shared file system.
    """

    data: str
    code: str = "."
    runs: str = "runs"
    shared: bool = Field(
        default=False,
        description="true: every node sees `runs` and `code` at the same paths (`make profile` "
        "writes it when a file written on one node is read on the others); preflight then does "
        "not check the file system type of a multi-node job's run root and code dir",
    )

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:  # replaces Strict's: removed keys get their own fix
        if isinstance(data, dict):
            old = [k for k in REMOVED_STORAGE_KEYS if k in data]
            if old:
                raise ValueError(
                    f"storage.{old[0]} is no longer used: each run directory "
                    f"(storage.runs/<run>) holds its own checkpoints/ and reports; remove "
                    f"{', '.join('storage.' + k for k in old)} and set storage.runs to a path "
                    "on the shared file system (e.g. /lustre/fsw/vitpod/runs)"
                )
            unknown = [str(k) for k in data if k not in cls.model_fields]
            if unknown:
                raise ValueError(unknown_key_message(unknown, list(cls.model_fields)))
        return data

    @field_validator("data", "code", "runs")
    @classmethod
    def _safe_path(cls, value: str | None) -> str | None:
        if value is not None and UNSAFE_PATH.search(value):
            raise ValueError(
                f"{value!r}: paths cannot contain double quotes, '%', '\\' or newlines"
            )
        return value
