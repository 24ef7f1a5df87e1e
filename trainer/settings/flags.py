"""The trainer's command line: one flag per TrainConfig field, a config file (configfile.py), a
run's plan (--plan: decision.py builds the rank's configuration from it) and the one order in
which they and a recipe's flags win (layered_argv). The command line is parsed once, here."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

from vitpod.registry.decision import Decision
from vitpod.registry.trainconfig import ordered_fields
from vitpod.registry.trainsections import NOT_PLANNED
from vitpod.trainer.config import ConfigError, TrainConfig, resolved
from vitpod.trainer.settings import timmargs, timmoptions, timmvalues
from vitpod.trainer.settings.configfile import read_config
from vitpod.trainer.settings.decision import from_plan

log = logging.getLogger(__name__)


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _cli_fields() -> list[dataclasses.Field]:
    return [f for f in ordered_fields() if not f.metadata.get("derived")]


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (
        ("dict", dict),
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
        message = _whole_names(message)
        raise ConfigError(f"{message}; see `python -m vitpod.trainer --help` for the valid flags")


def _whole_names(message: str) -> str:
    """timm's parser takes a flag's unique prefix (timm's documented JSD command types --jsd for
    --jsd-loss); vitpod's takes whole names (allow_abbrev=False): name the flag it stands for."""
    head = "unrecognized arguments: "
    if not message.startswith(head):
        return message
    timm_flags = [f for o in timmoptions.OPTIONS for f in o.flags if f.startswith("--")]
    said, rest, after = [], [], False
    for token in message.removeprefix(head).split(" "):
        name = token.partition("=")[0]
        whole = [f for f in timm_flags if f.startswith(name)] if name.startswith("--") else []
        if len(whole) == 1:
            said.append(f"{name}: timm's train.py reads it as {whole[0]} (a prefix); vitpod "
                        f"takes whole flag names: type {whole[0]}")  # fmt: skip
        elif not (after and not token.startswith("-")):  # not an abbreviation's value
            rest.append(token)
        after = len(whole) == 1 or (after and not token.startswith("-"))
    return "; ".join(said + ([head + " ".join(rest)] if rest else []))


def _cli_value(option: timmoptions.TimmOption | None, kind: Any) -> Any:
    """The argparse type of a flag: its kind, then timm's value spelled as vitpod's (a converter
    that means "not set" (SKIP) for some input is no command-line type)."""
    convert = option.value if option is not None else None
    if convert not in (timmvalues.dataset_name, timmvalues.amp_dtype_name, timmvalues.opt_name,
                       timmvalues.compile_backend):  # fmt: skip
        return kind

    def typed(text: str) -> Any:
        try:
            return convert(kind(text))
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = getattr(kind, "__name__", "value")
    return typed


def _kwargs_pair(text: str) -> tuple[str, Any]:
    try:
        return timmvalues.kwarg_pair(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _timm_option(field: str, flags: Sequence[str]) -> timmoptions.TimmOption | None:
    """timm's option spelled as one of the field's flags (its values are timm's too)."""
    return next((o for o in timmoptions.OPTIONS if o.field == field and set(o.flags) & set(flags)),
                None)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m vitpod.trainer",
        description="Train a timm VOLO/ViT model on every rank.",
        allow_abbrev=False,  # a misspelt flag is an error, never silently another flag
        # A flag not given sets nothing: what was given is what the namespace holds, and
        # TrainConfig's own defaults fill the rest (the planner asks what was given).
        argument_default=argparse.SUPPRESS,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in _cli_fields():
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        if f.name == "data_dir":  # the positional (SUPPRESS: absent sets nothing) or --data-dir
            group.add_argument("data", nargs="?", metavar="DATA_DIR", help=meta["help"])
            group.add_argument("--data-dir", dest="data_dir", metavar="DIR",
                               help="dataset root (timm's name)")  # fmt: skip
            continue
        flags = meta["flags"] or (flag_name(f),)
        kind = _field_type(f)
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(*flags, dest=f.name, action=action,
                               help=f"{meta['help']} (default: {f.default})")  # fmt: skip
        elif kind is dict:
            group.add_argument(*flags, dest=f.name, type=_kwargs_pair, nargs="*",
                               metavar="KEY=VALUE", help=meta["help"])  # fmt: skip
        else:
            typed = _cli_value(_timm_option(f.name, flags), meta.get("type", kind))
            group.add_argument(
                *flags, dest=f.name, type=typed, choices=meta.get("choices"),
                nargs=meta.get("nargs"), const=meta.get("const"), help=meta["help"],
            )  # fmt: skip
    _add_timm_options(parser)
    return parser


def _add_timm_options(parser: argparse.ArgumentParser) -> None:
    """timm's flags vitpod has under another spelling (--torchcompile), and every timm flag that
    sets no field: parsed as timm parses them, then recorded or refused by parse_args."""
    group = parser.add_argument_group(
        "timm train.py", "timm's other options: no effect here, or refused with the reason "
        "(docs/trainer.md#timms-trainpy-options)"
    )  # fmt: skip
    known = parser._option_string_actions
    for option in timmoptions.OPTIONS:
        flags = [f for f in option.flags if f not in known]
        if not flags:
            continue
        if option.field is not None:
            const = option.value("inductor") if option.nargs == "?" and option.value else None
            group.add_argument(
                *flags,
                dest=option.field,
                nargs=option.nargs,
                const=const,
                type=_cli_value(option, option.kind),
                help=argparse.SUPPRESS,
            )
            continue  # fmt: skip
        dest = timmargs.dest(option.key)
        if option.kind is bool:
            group.add_argument(*flags, dest=dest, action="store_true", help=argparse.SUPPRESS)
        else:
            group.add_argument(*flags, dest=dest, type=option.kind, nargs=option.nargs,
                               help=argparse.SUPPRESS)  # fmt: skip


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
    if action.nargs in ("+", "*"):
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


def _as_flags(values: dict[str, Any], path: str) -> list[str]:
    """A config file's values as flags (the data dir first), checked by the
    trainer's parser: a wrong type or choice is refused naming the file and the flag."""
    fields = {f.name: f for f in _cli_fields()}
    positional, flags = [], []
    for name, value in values.items():
        if name.startswith("timm_") and name not in fields:  # a timm option of no field
            flags += _timm_tokens(timmoptions.TIMM[name.removeprefix("timm_")], value)
            continue
        f, flag = fields[name], _long_flag(fields[name])
        if value is None:
            if f.default is not None:
                raise ConfigError(f"--config {path}: {name}: null; give a value or drop the key")
        elif name == "data_dir":
            positional = [str(value)]
        elif _field_type(f) is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {name}: {value!r}; write true or false")
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, *(f"{k}={v!r}" for k, v in value.items())] if value else []
        elif isinstance(value, list | tuple):
            flags += [flag, *map(_text, value)]
        else:
            flags.append(f"{flag}={_text(value)}")
    try:
        build_parser().parse_args([*positional, *flags])
    except ConfigError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    return [*positional, *flags]


def _timm_tokens(option: timmoptions.TimmOption, value: Any) -> list[str]:
    if option.kind is bool:
        return [option.flag] if value else []
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [option.flag, *map(_text, value)]
    return [f"{option.flag}={_text(value)}"]


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def config_path(argv: Sequence[str]) -> str | None:
    """The last -c/--config FILE of argv."""
    path = None
    for name, tokens in _chunks(build_parser(), argv):
        if name == "config":
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
        return _fit_recipe_warmup([*base, *fixed, *argv], base, [*fixed, *argv])
    parser = build_parser()
    own = _chunks(parser, argv)
    above = {dest for dest, _ in [*own, *_chunks(parser, fixed)]} | set(owned)
    if any(dest == "data_dir" for dest, _ in _chunks(parser, base)):
        above.add("data_dir")
    layer = {k: v for k, v in read_config(path, config_keys(), above).items() if k not in above}
    below = [t for dest, tokens in _chunks(parser, base) if dest not in layer for t in tokens]
    rest = [t for dest, tokens in own if dest != "config" for t in tokens]
    above_base = [*_as_flags(layer, path), *fixed, *rest]
    return _fit_recipe_warmup([*below, *above_base], base, above_base)


def _fit_recipe_warmup(argv: list[str], base: Sequence[str], given: list[str]) -> list[str]:
    """A warmup the user did not give (the recipe's, base's, or the default) that does not fit
    the run's --epochs (a short run of a 300-epoch recipe) shortens to the recipe's share of
    the run, said once in the log; a warmup the user gave (flag or config file) is left for
    the checks to refuse."""
    parser = build_parser()
    if any(d == "warmup_epochs" for d, _ in _chunks(parser, given)):
        return argv
    try:
        ns, _ = parser.parse_known_args(argv)
        recipe, _ = parser.parse_known_args(list(base))
    except ConfigError:
        return argv  # parse_args names the bad flag
    default = TrainConfig()
    warmup, epochs = (getattr(ns, k, getattr(default, k)) for k in ("warmup_epochs", "epochs"))
    if warmup <= 0 or warmup < epochs:
        return argv
    base_warmup, base_epochs = (getattr(recipe, k, getattr(default, k))
                                for k in ("warmup_epochs", "epochs"))  # fmt: skip
    share = base_warmup / max(base_epochs, 1)
    fitted = min(epochs - 1, max(0, round(epochs * share)))
    whose = ("the recipe's" if any(d == "warmup_epochs" for d, _ in _chunks(parser, base))
             else "vitpod's default")  # fmt: skip
    _say_once(f"--warmup-epochs: {whose} {warmup} does not fit --epochs "
              f"{epochs}; warming up {fitted} ({whose} share, {base_warmup}/"
              f"{base_epochs} epochs); give --warmup-epochs to choose")  # fmt: skip
    return [*argv, "--warmup-epochs", str(fitted)]


@cache
def _say_once(message: str) -> None:
    log.warning("%s", message)


def _timm_layout(values: dict[str, Any]) -> None:
    """timm's spellings of vitpod settings: --input-size C H W is --img-size H (square RGB only),
    --experiment NAME puts the run in OUTPUT/NAME."""
    if values.get("input_size") is not None:
        channels, height, width = values["input_size"]
        if channels != 3 or height != width:
            raise ConfigError(f"--input-size {channels} {height} {width}: vitpod trains square RGB "
                              f"images; give --input-size 3 N N or --img-size N")  # fmt: skip
        values["img_size"] = height
    if values.get("experiment"):
        values["output"] = os.path.join(values.get("output", TrainConfig.output),
                                        values["experiment"])  # fmt: skip


def parse_given(argv: Sequence[str]) -> tuple[TrainConfig, frozenset[str]]:
    """The command line parsed once (layered_argv's precedence, a config file read), not yet
    resolved (world size 1): the configuration and the names of the fields its flags set (at
    their default value too). ConfigError names a bad flag. cfg.requested: args.yaml's values."""
    values = vars(build_parser().parse_args(layered_argv(argv)))
    data = values.pop("data", None)  # the positional DATA_DIR; timm: --data-dir wins
    if data is not None and values.get("data_dir") is None:
        values["data_dir"] = data
    values.pop("config", None)
    if (path := config_path(argv)) is not None:
        values["config"] = path
    for f in _cli_fields():  # argparse gives nargs values as a list: the field's tuple
        if str(f.type).startswith("tuple") and isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
        if str(f.type).startswith("dict") and isinstance(values.get(f.name), list):
            values[f.name] = dict(values[f.name])  # KEY=VALUE pairs, last wins
    unmapped = {k.removeprefix("timm_"): values.pop(k) for k in list(values)
                if k.startswith("timm_")}  # fmt: skip
    no_effect, refused = timmargs.unmapped_values(unmapped)
    if refused:
        raise ConfigError("; ".join(refused))
    parsed = TrainConfig(**values)
    requested = {f.name: getattr(parsed, f.name) for f in _cli_fields()
                 if f.name not in NOT_PLANNED}  # fmt: skip
    requested.update({k: v for k, v in unmapped.items() if timmoptions.TIMM[k].flag in no_effect})
    given = set(values) | ({"img_size"} if values.get("input_size") is not None else set())
    _timm_layout(values)
    cfg = TrainConfig(**values, requested=timmargs.timm_names(requested), no_effect=no_effect)
    return cfg, frozenset(given)


def configure(
    argv: Sequence[str] | None = None, world_size: int = 1
) -> tuple[TrainConfig, Decision | None]:
    """A rank's configuration: its flags resolved for the world size (`vitpod-train DATA_DIR
    [flags]`; decision None), or `--plan RUN/plan.json` alone (decision.py: the planner's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg, given = parse_given(argv)
    if cfg.plan is None:
        return resolved(cfg, world_size), None
    if given - {"plan", "print_config"}:  # named as typed (not a warmup layered_argv fitted)
        extra = [t[0].partition("=")[0] for d, t in _chunks(build_parser(), argv)
                 if d not in ("plan", "print_config")]  # fmt: skip
        raise ConfigError(f"{', '.join(extra)} with --plan {cfg.plan}: a planned rank reads its "
                          "configuration from plan.json alone; drop the flag, or plan the run "
                          "again with it (make render/pretrain ARGS=...)")  # fmt: skip
    planned, decision = from_plan(cfg.plan, world_size)
    planned.print_config = cfg.print_config
    return planned, decision


def parse_args(argv: Sequence[str] | None = None, world_size: int = 1) -> TrainConfig:
    """configure()'s configuration; raises ConfigError on bad input."""
    return configure(argv, world_size)[0]
