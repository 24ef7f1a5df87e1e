"""`-c/--config FILE`: vitpod's config.json or args.yaml (TrainConfig keys, YAML or JSON), or
timm train.py's args.yaml (trainer/settings/timmargs.py reads it)."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

import yaml

from vitpod.registry.io import unknown_key_message
from vitpod.trainer.config import ConfigError
from vitpod.trainer.settings import timmargs

# Keys of a run's config.json (and --print-config) that record how it started or what it
# derived; a file fed back sets them again by itself, so they are read as nothing.
RECORD_KEYS = ("config", "plan", "print_config", "world_size", "global_batch_size", "no_effect")


def read_config(path: str, fields: set[str], given: Collection[str] = ()) -> dict[str, Any]:
    """The TrainConfig values of FILE (only the keys it holds); ConfigError names the file, the
    key and the fix. `given`: the command line's destinations, which win over the file's."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"--config {path}: no such file; pass a YAML or JSON file of trainer keys (a run's "
            "config.json or args.yaml) or timm train.py's args.yaml"
        )
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not YAML or JSON ({exc})") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys to values")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    if timmargs.is_timm(data, fields):
        try:
            return timmargs.from_timm(data, fields, given)
        except ConfigError as exc:
            raise ConfigError(f"--config {path} (timm's args.yaml): {exc}") from None
    data = {k: v for k, v in data.items() if k not in RECORD_KEYS}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"--config {path}: {unknown_key_message(unknown, sorted(fields))}")
    return data
