"""One user-facing error type for bad profiles, recipes and overrides, and pydantic -> message."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

# Keys people write by habit, and where the value belongs instead.
COMMON_MISTAKES = {
    "gpus": "gpus_per_node",
    "gpu_count": "gpus_per_node",
    "cpus": "cpus_per_node",
    "partition": "partitions",
    "image": "container.image",
    "mounts": "container.mounts",
    "ntasks_per_node": "tasks_per_node",
    "time_limit": "time (inside partitions.<stage>)",
    "mpi_type": "mpi",
    "numa_map": "binding",
    "hca_map": "binding",
    "nics": "binding[].hca (and fabric.nics_per_node)",
    "batch": "batch_size",
    "lr_base_batch": "lr_base_size",
    "token_label_dir": "token_label_data",
}


class ConfigError(ValueError):
    """Bad user input; the message names the field and the fix. The CLI exits with status 2."""


def unknown_key_message(unknown: Iterable[str], valid: list[str]) -> str:
    """'unknown key(s) ...; did you mean ...; valid keys: ...' for one mapping."""
    hints = []
    for key in unknown:
        guess = COMMON_MISTAKES.get(key) or next(
            iter(difflib.get_close_matches(key, valid, 1)), None
        )
        hints.append(f"{key!r} (did you mean {guess!r}?)" if guess else repr(key))
    return f"unknown key(s) {', '.join(hints)}; valid keys: {valid}"


class Strict(BaseModel):
    """Base for config models: frozen, and unknown keys raise with the valid ones and a hint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            valid = list(cls.model_fields)
            unknown = [str(k) for k in data if k not in valid]
            if unknown:
                raise ValueError(unknown_key_message(unknown, valid))
        return data


def describe(exc: ValidationError, source: str) -> ConfigError:
    """The first pydantic error as one line: '<source>: field a.b: message'."""
    err = exc.errors(include_url=False)[0]
    field = ".".join(str(p) for p in err["loc"]) or "(top level)"
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = "required field is missing; add it"
    elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
        message = f"{message} (got {err['input']!r})"
    more = f" (and {exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else ""
    return ConfigError(f"{source}: field {field}: {message}{more}")
