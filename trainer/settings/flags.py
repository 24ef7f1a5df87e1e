"""The trainer's command line: one flag per TrainConfig field, a config file (configfile.py), a
run's plan (--plan) and the one order in which they and a recipe's flags win (layered_argv)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from vitpod.trainer.config import ConfigError, TrainConfig, resolve
from vitpod.trainer.settings.configfile import read_config
from vitpod.trainer.settings.decision import read_plan, refuse_overrides


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("derived")]


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (
        ("bool", bool),
        ("int", int),
        ("float", float),
        ("tuple[float", float),
        ("tuple[int", int),
    ):
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
                *flags, dest=f.name, type=meta.get("type", kind), default=f.default,
                choices=meta.get("choices"),
                nargs=meta.get("nargs"), const=meta.get("const"), help=meta["help"],
            )  # fmt: skip
    return parser


def _long_flag(f: dataclasses.Field) -> str:
    return next((x for x in f.metadata["flags"] if x.startswith("--")), flag_name(f))


def config_keys() -> set[str]:
    """The keys a config file may set: every flag's field but the file itself."""
    return {f.name for f in _cli_fields()} - {"config", "plan", "print_config"}


def _arity(action: argparse.Action, rest: list[str]) -> int:
    """How many of `rest` argparse gives `action` as values."""
    if action.nargs is None:
        return 1
    if action.nargs == "?":
        return 1 if rest and not rest[0].startswith("-") else 0
    if action.nargs == "+":
        return next((i for i, t in enumerate(rest) if t.startswith("-")), len(rest))
    return int(action.nargs)  # type: ignore[arg-type]


def _chunks(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """argv cut as argparse reads it: (field, tokens) per flag or positional; a flag argparse
    does not know keeps its token under '?' (argparse refuses it when parsing)."""
    actions = parser._option_string_actions
    out: list[tuple[str, list[str]]] = []
    argv, i = list(argv), 0
    while i < len(argv):
        token = argv[i]
        name, eq, _ = token.partition("=")
        action = actions.get(name if eq else token)
        if action is None:
            out.append(("?" if token.startswith("-") else "data_dir", [token]))
            i += 1
            continue
        n = 0 if eq else _arity(action, argv[i + 1 :])
        out.append((action.dest, argv[i : i + 1 + n]))
        i += 1 + n
    return out


def _as_flags(values: dict[str, Any], path: str, source: str = "--config") -> list[str]:
    """A config file's (or plan's) values as flags (the data dir first), checked by the
    trainer's parser: a wrong type or choice is refused naming the file and the flag."""
    fields = {f.name: f for f in _cli_fields()}
    positional, flags = [], []
    for name, value in values.items():
        f, flag = fields[name], _long_flag(fields[name])
        if value is None:
            if f.default is not None:
                raise ConfigError(f"{source} {path}: {name}: null; give a value or drop the key")
        elif name == "data_dir":
            positional = [str(value)]
        elif _field_type(f) is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{source} {path}: {name}: {value!r}; write true or false")
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            flags += [flag, *map(_text, value)]
        else:
            flags.append(f"{flag}={_text(value)}")
    try:
        build_parser().parse_args([*positional, *flags])
    except ConfigError as exc:
        raise ConfigError(f"{source} {path}: {exc}") from None
    return [*positional, *flags]


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def config_path(argv: Sequence[str], dest: str = "config") -> str | None:
    """The last -c/--config FILE of argv (or the last value of another single-value flag)."""
    path = None
    for name, tokens in _chunks(build_parser(), argv):
        if name == dest:
            path = tokens[0].partition("=")[2] if len(tokens) == 1 else tokens[-1]
    return path


def layered_argv(
    argv: Sequence[str],
    base: Sequence[str] = (),
    fixed: Sequence[str] = (),
    owned: Iterable[str] = (),
) -> list[str]:
    """The one precedence, command line > config file > base (a recipe's flags) > defaults, as
    one argv in which a flag's last value wins: the config file's values (argv's -c FILE, read
    here) replace base's flags for the keys it sets, and argv's own flags follow. `fixed` (flags
    the caller sets for every run: the planner's run directory) follow the file, whose `owned`
    keys are dropped. Without a config file: base, fixed, argv as given."""
    path = config_path(argv)
    if path is None:
        return [*base, *fixed, *argv]
    parser = build_parser()
    own = _chunks(parser, argv)
    above = {dest for dest, _ in [*own, *_chunks(parser, fixed)]} | set(owned)
    if any(dest == "data_dir" for dest, _ in _chunks(parser, base)):
        above.add("data_dir")
    layer = {k: v for k, v in read_config(path, config_keys()).items() if k not in above}
    below = [t for dest, tokens in _chunks(parser, base) if dest not in layer for t in tokens]
    rest = [t for dest, tokens in own if dest != "config" for t in tokens]
    return [*below, *_as_flags(layer, path), *fixed, *rest]


def parse_args(argv: Sequence[str] | None = None, world_size: int = 1) -> TrainConfig:
    """Parse flags and a config file over a run's plan (layered_argv's precedence), fill model
    defaults; raises ConfigError on bad input. cfg.requested keeps the parsed flags for args.yaml.

    With --plan RUN/plan.json (how the planner starts ranks) the plan's resolved configuration is
    the base layer; argv overrides it, but not its engine or layout. The plan's rules that
    depend on the world size (--elastic's accumulation, --global-batch's per-rank batch) are
    applied again for the world size this job got (a node range, a resume elsewhere)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    plan_path = config_path(argv, "plan")
    base: list[str] = []
    decision = None
    if plan_path is not None:
        decision = read_plan(plan_path)
        assert decision.trainer is not None  # read_plan refuses a plan without one
        base = _as_flags(decision.trainer.values(), plan_path, "--plan")
    ns = build_parser().parse_args(layered_argv(argv, base=base))
    ns.config = config_path(argv)
    for f in _cli_fields():  # argparse gives nargs values as a list: the field's tuple
        if str(f.type).startswith("tuple") and isinstance(getattr(ns, f.name), list):
            setattr(ns, f.name, tuple(getattr(ns, f.name)))
    if decision is not None:
        refuse_overrides(vars(ns), decision, plan_path or "")
    requested = {k: v for k, v in vars(ns).items() if k not in ("config", "plan", "print_config")}
    cfg = resolve(TrainConfig(**vars(ns), world_size=world_size, requested=requested))
    if decision is not None and cfg.engine != decision.engine.name:
        raise ConfigError(
            f"--plan {plan_path}: its trainer settings run engine {cfg.engine!r} but its engine is "
            f"{decision.engine.name!r} (edited by hand?); plan the run again"
        )
    return cfg
