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
        description="true: declared by whoever wrote the profile: every path a job uses (run "
        "root, code dir), wherever it is, is seen by every node as one file system (the local "
        "test profiles: all nodes are one host); preflight then checks no file system type. "
        "`make profile` writes shared_paths instead",
    )
    shared_paths: list[str] = Field(
        default_factory=list,
        description="absolute paths that `make profile` tested (a file written on one node was "
        "read on the others): a run root or code dir at or below one of them passes the "
        "preflight's shared-storage check; any other path has its file system type checked",
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

    @field_validator("shared_paths")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        relative = [p for p in value if not p.startswith("/")]
        if relative:
            raise ValueError(
                f"{relative[0]!r}: shared_paths are absolute paths, as `make profile` tested "
                "them (write /path/to/runs)"
            )
        return value
