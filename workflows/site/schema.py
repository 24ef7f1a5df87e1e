"""The pydantic base of profile and recipe models, and a validation error as one message."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from vitpod.registry.io import unknown_key_message
from vitpod.workflows.errors import ConfigError


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
