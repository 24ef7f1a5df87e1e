"""The trainer's command line: one flag per TrainConfig field, and a YAML file of the same keys."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from vitpod.registry.io import unknown_key_message
from vitpod.trainer.config import ConfigError, TrainConfig, resolve


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("derived")]


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("tuple[float", float)):
        if text.startswith(name):
            return kind
    return str


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one message naming the flag) instead of exiting, so a
    login node's planner refuses a bad flag before anything is written or submitted."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ConfigError(f"{message}; see `python -m vitpod.trainer --help` for the valid flags")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m vitpod.trainer",
        description="Train a timm VOLO/ViT model on every rank.",
        allow_abbrev=False,  # a misspelt flag is an error, never silently another flag
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in _cli_fields():
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        if f.name == "data_dir":
            group.add_argument("data_dir", nargs="?", default=None, help=meta["help"])
            continue
        flags = meta["flags"] or (flag_name(f),)
        kind = _field_type(f)
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(
                *flags, dest=f.name, action=action, default=f.default, help=meta["help"]
            )
        else:
            group.add_argument(
                *flags, dest=f.name, type=kind, default=f.default, choices=meta.get("choices"),
                nargs=meta.get("nargs"), const=meta.get("const"), help=meta["help"],
            )  # fmt: skip
    return parser


def _yaml_defaults(path: str) -> dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file; pass a YAML file of trainer keys")
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys to values")
    valid = {f.name for f in _cli_fields()} - {"config", "print_config"}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ConfigError(f"--config {path}: {unknown_key_message(unknown, sorted(valid))}")
    return data


def parse_args(argv: list[str] | None = None, world_size: int = 1) -> TrainConfig:
    """Parse flags (YAML first, flags win), fill model defaults; raises ConfigError on bad input."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_yaml_defaults(pre.config))
    ns = parser.parse_args(argv)
    cfg = TrainConfig(**vars(ns), world_size=world_size)
    return resolve(cfg)
