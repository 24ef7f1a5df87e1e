"""plan.json's `trainer` section: the resolved TrainConfig in its flag groups, checked by type.

Each section holds exactly the fields of one flag group (registry/trainconfig.py's `group`),
and the values are validated against TrainConfig's own annotations, so a hand-edited or foreign
plan.json is refused naming the section and key before any rank starts.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator

from vitpod.registry.io import unknown_key_message
from vitpod.registry.trainconfig import ConfigError, TrainConfig

NOT_PLANNED = ("config", "plan", "print_config")
"""Flags that say where a configuration comes from or what to do with it, not what it is."""


@cache
def groups() -> dict[str, str]:
    """Every planned TrainConfig field -> its flag group (data, model, precision, ...)."""
    return {
        f.name: f.metadata["group"]
        for f in dataclasses.fields(TrainConfig)
        if not f.metadata.get("derived") and f.name not in NOT_PLANNED
    }


@cache
def _adapter() -> TypeAdapter[TrainConfig]:
    return TypeAdapter(TrainConfig)


class TrainerSettings(BaseModel):
    """The trainer's resolved configuration, one mapping per flag group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: dict[str, Any]
    model: dict[str, Any]
    precision: dict[str, Any]
    optim: dict[str, Any]
    parallel: dict[str, Any]
    run: dict[str, Any]
    no_effect: dict[str, Any] = {}
    """timm flags given that change nothing here, under timm's key with the value given
    (pin_mem: true): the ranks take them as given, so config.json's `no_effect` and args.yaml
    record them as a run by hand does."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """A plan written before parallel.topology became parallel.exchange still reads."""
        parallel = data.get("parallel") if isinstance(data, dict) else None
        if isinstance(parallel, dict) and "topology" in parallel and "exchange" not in parallel:
            parallel = {("exchange" if k == "topology" else k): v for k, v in parallel.items()}
            data = {**data, "parallel": parallel}
        return data

    @model_validator(mode="after")
    def _typed(self) -> TrainerSettings:
        for section, values in self.sections().items():
            want = {name for name, group in groups().items() if group == section}
            for key in sorted(set(values) ^ want):
                missing = key in want
                raise ValueError(
                    f"{section}.{key}: {'missing' if missing else 'not a trainer setting'}"
                )
        try:
            _adapter().validate_python({**self.values(), "world_size": 1})
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            key = str(err["loc"][0]) if err["loc"] else "?"
            raise ValueError(f"{groups().get(key, '?')}.{key}: {err['msg']}") from None
        return self

    def config(self, world_size: int = 1) -> TrainConfig:
        """The configuration these sections hold, typed by TrainConfig's annotations (tuples
        again), as it is: nothing is parsed or resolved again."""
        return _adapter().validate_python({**self.values(), "world_size": world_size})

    def sections(self) -> dict[str, dict[str, Any]]:
        """The flag groups (no_effect is none)."""
        return {name: getattr(self, name) for name in type(self).model_fields
                if name != "no_effect"}  # fmt: skip

    def values(self) -> dict[str, Any]:
        """Every setting by field name, as stored (JSON types: lists for tuples)."""
        return {k: v for section in self.sections().values() for k, v in section.items()}

    @classmethod
    def of(cls, cfg: TrainConfig) -> TrainerSettings:
        """The sections of a resolved configuration."""
        record = cfg.record()
        sections: dict[str, dict[str, Any]] = {name: {} for name in cls.model_fields}
        for name, group in groups().items():
            value = record[name]
            sections[group][name] = list(value) if isinstance(value, tuple) else value
        # cfg.no_effect's flags are timm's keys spelled as flags (--pin-mem, --local_rank)
        sections["no_effect"] = {
            key: value for key, value in cfg.requested.items()
            if {f"--{key}", f"--{key.replace('_', '-')}"} & set(cfg.no_effect)
        }  # fmt: skip
        return cls(**sections)

    def lines(self) -> list[str]:
        """One readable line per section, for the job script and the rank log."""
        import json

        return [f"{name}: {json.dumps(values)}" for name, values in self.sections().items()]


@cache
def _field_adapter(name: str) -> TypeAdapter[Any]:
    return TypeAdapter(typing.get_type_hints(TrainConfig)[name])


def overridden(cfg: TrainConfig, overrides: Mapping[str, Any]) -> TrainConfig:
    """cfg with `overrides` (TrainConfig field names -> values, each checked against its
    field's type): how vitpod itself sets a field (a sweep point's batch, a node range's pinned
    batch). ConfigError names an unknown key with the valid ones, or a value of the wrong type."""
    unknown = sorted(set(overrides) - set(groups()))
    if unknown:
        raise ConfigError(f"overrides: {unknown_key_message(unknown, sorted(groups()))}")
    typed = {}
    for key, value in overrides.items():
        try:
            typed[key] = _field_adapter(key).validate_python(value)
        except ValidationError as exc:
            msg = exc.errors(include_url=False)[0]["msg"]
            raise ConfigError(f"overrides: {key}={value!r}: {msg}") from None
    return dataclasses.replace(cfg, **typed)
