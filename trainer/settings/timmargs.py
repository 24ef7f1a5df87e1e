"""timm train.py's options at work (the table: trainer/settings/timmoptions.py): a timm
args.yaml given to `-c` read as the command line reads the same flags (from_timm), what an
option that sets no field asks for (unmapped_values), and a run's args.yaml under timm's names
(timm_names), which timm's own train.py reads back."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import yaml

from vitpod.trainer.config import ConfigError, TrainConfig
from vitpod.trainer.settings.timmoptions import (
    NO_EFFECT,
    TIMM,
    TIMM_KEY,
    UNMAPPED,
    TimmOption,
)
from vitpod.trainer.settings.timmvalues import SKIP

# timm's dataset_factory: the split names it resolves to the same train or eval split
_SPLIT_SYNONYMS = {
    "train_split": ("train", "training"),
    "val_split": ("validation", "val", "valid", "eval", "evaluation"),
}


def dest(key: str) -> str:
    """The parser's destination of an option that sets no field (flags.py pops it)."""
    return f"timm_{key}"


def asks_nothing(option: TimmOption, value: Any) -> bool:
    """At timm's default (or its None/empty equivalent) the option asks for nothing."""
    default = option.default
    if option.key == "lr_base_scale":  # vitpod's scaling is linear; timm's '' is checked by -c
        return value in ("", "linear")
    if option.key in _SPLIT_SYNONYMS:  # timm reads DATA/val (or train) for any of these names
        return value in _SPLIT_SYNONYMS[option.key]
    if isinstance(default, list | tuple) and isinstance(value, list | tuple):
        return [float(v) if option.kind is float else v for v in value] == list(default)
    return value == default or (option.kind is bool and not value and not default)


def unmapped_values(values: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Of {timm key: value} for options that set no field: (no effect: {flag: why}, refusals)."""
    quiet: dict[str, str] = {}
    refused: list[str] = []
    for key, value in values.items():
        option = UNMAPPED[key]
        if asks_nothing(option, value):
            continue
        if option.use == NO_EFFECT:
            quiet[option.flag] = option.why
        else:
            refused.append(option.refusal(value))
    return quiet, refused


def is_timm(data: dict[str, Any], fields: set[str]) -> bool:
    """A file holding a key only timm has (timm's args.yaml holds all of them)."""
    return any(key in TIMM and key not in fields for key in data)


def from_timm(
    data: dict[str, Any], fields: set[str], given: Collection[str] = ()
) -> dict[str, Any]:
    """TrainConfig values of a timm args.yaml (keys only vitpod has, as in a vitpod run's
    args.yaml, pass through and win); options that set no field come back under dest(key)
    when they ask for something (flags.py records or refuses them as on the command line).
    ConfigError names every key vitpod refuses, each with its reason."""
    values: dict[str, Any] = {}
    own: dict[str, Any] = {}
    unmapped: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        if key not in TIMM:
            if key in fields:
                own[key] = value
            else:
                unknown.append(key)
            continue
        option = TIMM[key]
        if option.field is None:
            if dest(key) not in given:  # typed on the command line: that value wins
                unmapped[key] = value
            continue
        if option.convert is not None:
            mapped = option.convert(value, data)
        elif option.value is not None:
            mapped = option.value(value)
        else:
            mapped = value
        if mapped is not SKIP:
            values[option.field] = mapped
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}: neither timm train.py's nor vitpod's")
    _, refused = unmapped_values(unmapped)
    if not any(k in given for k in ("lr", dest("lr_base_scale"))):  # the command line's win
        refused += _lr_scaling(data)
    if refused:
        raise ConfigError("; ".join(refused) + " (set these keys to timm's default or drop "
                          "them: docs/trainer.md#timms-trainpy-options)")  # fmt: skip
    asked = {dest(k): v for k, v in unmapped.items() if not asks_nothing(UNMAPPED[k], v)}
    return {**values, **own, **asked}


def timm_names(requested: dict[str, Any]) -> dict[str, Any]:
    """A run's parsed flags as args.yaml: under timm's key and in timm's form where timm has
    the option (so timm's train.py `-c` reads it), and under vitpod's name where it does not
    or where timm's form loses the value (then after timm's key: vitpod reads it last)."""
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name, value in requested.items():
        value = list(value) if isinstance(value, tuple) else value
        key = TIMM_KEY.get(name)
        if key is None:
            extra[name] = value
            continue
        shown = _to_timm(name, value)
        out[key] = shown
        option = TIMM[key]
        back = option.value(shown) if option.value is not None else shown
        if key != name and back != value:
            extra[name] = value
    return {**out, **extra}


def args_yaml(cfg: TrainConfig, loader: Any = None) -> str:
    """A run's args.yaml: every flag as parsed (cfg.requested: timm's names, YAML lists for
    tuples), so `-c args.yaml` gives the same configuration back. A flag left unset that the run
    resolved (the class count, the model's drop path and crop, the `loader`'s DataConfig mean
    and std) is written as resolved: timm's train.py reads null as its own default (1000
    classes, no drop path, the model's crop and normalisation)."""
    resolved = {k: getattr(cfg, k) for k in ("num_classes", "drop_path", "crop_pct")}
    resolved |= {k: getattr(loader, k) for k in ("mean", "std")} if loader is not None else {}
    filled = {k: v for k, v in resolved.items()
              if v is not None and cfg.requested.get(k, 0) is None}  # fmt: skip
    values = {**cfg.requested, **filled}
    return yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in values.items()},
                          sort_keys=False)  # fmt: skip


def _to_timm(name: str, value: Any) -> Any:
    if name == "compile":
        return "inductor" if value == "on" else None
    if name == "amp_dtype":
        return {"fp16": "float16", "bf16": "bfloat16"}.get(value, value)
    if name == "dataset":
        return "" if value == "folder" else f"torch/{value}" if value.startswith("cifar") else value
    if name == "aa":
        return value or None
    if name == "resume":
        return "" if value in ("auto", "none") else value
    if name == "initial_checkpoint":
        return value or ""
    return value


def _lr_scaling(data: dict[str, Any]) -> list[str]:
    """timm scales lr_base by sqrt(batch) for adam/lamb when lr is unset; vitpod linearly."""
    if data.get("lr") is not None or "lr_base_scale" not in data:
        return []
    scale = data.get("lr_base_scale") or (
        "sqrt" if any(o in str(data.get("opt", "sgd")).lower() for o in ("ada", "lamb"))
        else "linear"
    )  # fmt: skip
    if scale == "linear":
        return []
    return [f"lr: None with lr_base_scale {scale!r} (vitpod scales lr_base linearly; give lr)"]
