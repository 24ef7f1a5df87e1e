"""Per-submission sbatch options: TIME, ACCOUNT, QOS, RESERVATION, CONSTRAINT, EXCLUDE and the
SBATCH_EXTRA pass-through (a pipeline's fine-tune: FT_<name>), checked before anything is
written; the one table of sbatch's long options and of those vitpod sets itself. Every command
that submits takes them with `add_flags` (make's SLURM_ARGS); the node range and requeue come
from the profile, and every #SBATCH line from one template (templates/partials/header.sh.j2)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from vitpod.workflows.errors import ConfigError

if TYPE_CHECKING:
    from vitpod.workflows.planning.spec import JobSpec

Arg = Literal["value", "optional", "none"]
_VALUE = """account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment
constraint container container-id core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task
deadline delay-boot dependency distribution error exclude export export-file extra extra-node-info
gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags hint input
job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu
mem-per-gpu mincpus network nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu
ntasks-per-node ntasks-per-socket open-mode output partition power prefer priority profile qos
reservation segment signal sockets-per-node switches thread-spec threads-per-core time time-min tmp
tres-bind tres-per-task uid wait-all-nodes wckey wrap"""
_OPTIONAL = "exclusive get-user-env nice no-kill oom-kill-step propagate resv-ports"
_NONE = """contiguous hold ignore-pbs no-requeue overcommit oversubscribe parsable quiet reboot
requeue spread-job stepmgr test-only use-min-nodes verbose wait"""
SBATCH_OPTIONS: dict[str, Arg] = {
    **dict.fromkeys(_VALUE.split(), "value"),
    **dict.fromkeys(_OPTIONAL.split(), "optional"),
    **dict.fromkeys(_NONE.split(), "none"),
}
"""sbatch's long options (Slurm 23.11 `sbatch --help`) and whether each takes a value."""

_NODE_TYPE = "the profile's node_types fields (tasks_per_node, gpus_per_node, cpus_per_task, mem)"
_LOGS = "vitpod writes Slurm's output into the run directory's logs/"
_SBATCH = "vitpod runs sbatch itself (make preflight runs sbatch --test-only)"
OWNED: dict[str, str] = {
    "nodes": "{p}NODES=", "time": "{p}TIME=", "account": "{p}ACCOUNT=", "qos": "{p}QOS=",
    "reservation": "{p}RESERVATION=", "constraint": "{p}CONSTRAINT=", "exclude": "{p}EXCLUDE=",
    "partition": "the profile's partitions.<stage>.name (CLUSTER= picks the profile)",
    "ntasks-per-node": _NODE_TYPE, "ntasks": _NODE_TYPE, "gpus-per-node": _NODE_TYPE,
    "gpus": _NODE_TYPE, "gres": _NODE_TYPE, "cpus-per-task": _NODE_TYPE, "mem": _NODE_TYPE,
    "mem-per-cpu": _NODE_TYPE, "mem-per-gpu": _NODE_TYPE,
    "output": _LOGS, "error": _LOGS, "open-mode": _LOGS, "chdir": _LOGS,
    "job-name": "vitpod names the job (make status and make list find it by that name)",
    "signal": "the profile's preemption: block (signal, grace_s)",
    "requeue": "the profile's preemption.requeue", "no-requeue": "the profile's preemption.requeue",
    "exclusive": "the profile's exclusive:",
    "dependency": "a pipeline chains its stages itself (afterok); one stage: vitpod submit "
    "--dependency",
    "array": "make token-labels (vitpod's job arrays; a scaling study is a job per point)",
    "export": "the profile's env: and secrets: (the ranks need the variables vitpod exports)",
    "parsable": _SBATCH, "test-only": _SBATCH, "wait": _SBATCH, "wrap": _SBATCH,
}  # fmt: skip
"""Options vitpod sets from the profile, the plan or a make variable: where to set each."""

FIELDS = ("account", "qos", "reservation", "constraint", "exclude", "extra")
VARIABLES = {f: "SBATCH_EXTRA" if f == "extra" else f.upper() for f in FIELDS}
"""The make variable of each field (a pipeline's fine-tune: FT_ in front)."""
_ALLOWED: dict[str, tuple[str, str, str]] = {
    "account": (r"[A-Za-z0-9_.-]+", "account name", "myproject"),
    "qos": (r"[A-Za-z0-9_.-]+", "QOS name", "high"),
    "reservation": (r"[A-Za-z0-9_.,-]+", "reservation name", "maint_0412"),
    "constraint": (r"[A-Za-z0-9_.\-&|,*\[\]():!]+", "node feature expression", "a100&ib"),
    "exclude": (r"[A-Za-z0-9_.\-\[\],/]+", "node list", "node[03-05],gpu7"),
}
"""Each field's characters (what sbatch takes, nothing a shell or #SBATCH line reads), for
its error: what it is and an example."""
_UNSAFE = "\n\r\0"


@dataclasses.dataclass(frozen=True)
class SbatchOptions:
    """Per-submission sbatch options as given ('' = not given: the profile's, else Slurm's).

    `extra`: more sbatch long options, a shell-quoted string ("--mail-type=END --comment='a b'"),
    a sequence of such words, or a mapping as submitit's slurm_additional_parameters
    ({"mail_type": "END", "hold": True}). `names`: the make variable each field's errors name
    (default: VARIABLES; a pipeline's fine-tune: FT_...)."""

    account: str = ""
    qos: str = ""
    reservation: str = ""
    constraint: str = ""
    exclude: str = ""
    extra: str | Sequence[str] | Mapping[str, Any] = ""
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def name(self, field: str) -> str:
        return self.names.get(field, VARIABLES[field])

    def given(self) -> dict[str, Any]:
        """The fields given, by name (for the manifest and `vitpod resume`)."""
        return {f: getattr(self, f) for f in FIELDS if _is_given(getattr(self, f))}

    def over(self, base: SbatchOptions) -> SbatchOptions:
        """Each field given here wins over `base`'s (a pipeline's FT_ACCOUNT over ACCOUNT)."""
        mine = self.given()
        values = {f: mine.get(f, getattr(base, f)) for f in FIELDS}
        names = {f: self.name(f) if f in mine else base.name(f) for f in FIELDS}
        return SbatchOptions(**values, names=names)


@dataclasses.dataclass(frozen=True)
class Sbatch:
    """The checked options: values as they go into #SBATCH lines, `extra` as --name[=value]
    words, and the variable that set each given field (`set_by`)."""

    account: str | None = None
    qos: str | None = None
    reservation: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    extra: tuple[str, ...] = ()
    set_by: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _is_given(value: Any) -> bool:
    return bool(value) if not isinstance(value, str) else value != ""


def options(value: SbatchOptions | Mapping[str, Any] | None, prefix: str = "") -> SbatchOptions:
    """The Python API's form (a mapping with FIELDS as keys, or SbatchOptions) as options whose
    errors name `prefix` + the make variable; an unknown key lists the valid ones."""
    names = {f: prefix + VARIABLES[f] for f in FIELDS}
    if value is None:
        return SbatchOptions(names=names)
    if isinstance(value, SbatchOptions):
        return dataclasses.replace(value, names=value.names or names)
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ConfigError(f"sbatch options {unknown}: unknown; valid keys: {', '.join(FIELDS)} "
                          "(time: the time= / finetune_time= arguments)")  # fmt: skip
    return SbatchOptions(**{k: v if k == "extra" else str(v) for k, v in value.items()},
                         names=names)  # fmt: skip


def check(opts: SbatchOptions, scheduler: str, profile: str) -> Sbatch:
    """Each given field's value, and SBATCH_EXTRA's options against SBATCH_OPTIONS and OWNED;
    ConfigError names the make variable and the fix. Nothing here asks Slurm."""
    given = opts.given()
    if given and scheduler != "slurm":
        names = ", ".join(opts.name(f) for f in given)
        raise ConfigError(f"{names}: profile {profile} has no Slurm (it runs on this machine), "
                          f"so nothing would read them; drop {names}")  # fmt: skip
    values: dict[str, Any] = {}
    for field, (pattern, what, example) in _ALLOWED.items():
        raw = getattr(opts, field)
        if raw == "":
            continue
        name, text = opts.name(field), str(raw)
        _check_text(name, text)
        text = text.strip()
        if not text:
            raise ConfigError(f"{name}={raw!r} is blank; give a {what} or leave {name} unset")
        if not re.fullmatch(pattern, text):
            raise ConfigError(f"{name}={raw!r} is not a Slurm {what} (no blanks or quotes); write "
                              f"e.g. {name}={example}")  # fmt: skip
        if field == "exclude" and "/" not in text:  # with '/': a file of node names (sbatch)
            _check_hostlist(name, text)
        values[field] = text
    name = opts.name("extra")
    extra = parse_extra(opts.extra, name, prefix=name.removesuffix(VARIABLES["extra"]))
    return Sbatch(**values, extra=extra, set_by={f: opts.name(f) for f in given})


_RANGE = r"\d+(?:-\d+)?"
_HOST = re.compile(rf"(?:[A-Za-z0-9_.-]*\[{_RANGE}(?:,{_RANGE})*\])*[A-Za-z0-9_.-]*")


def _check_hostlist(name: str, text: str) -> None:
    """A Slurm host list (node[01-04,07],gpu7): brackets closed, ranges low-high of numbers, no
    empty name; checked here because Slurm's own refusal comes only at sbatch."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth < 0 or depth > 1:
            break
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    bad = depth != 0 or any(not item or not _HOST.fullmatch(item) for item in items)
    ranges = re.findall(r"(\d+)-(\d+)", "".join(re.findall(r"\[[^\]]*\]", text)))
    if bad or any(int(low) > int(high) for low, high in ranges):
        raise ConfigError(f"{name}={text!r} is not a Slurm host list (names, or prefix[ranges] "
                          f"with closed brackets and low-high ranges); write e.g. "
                          f"{name}=node[03-05],gpu7")  # fmt: skip


def _check_text(name: str, text: str) -> None:
    if any(c in text for c in _UNSAFE):
        raise ConfigError(
            f"{name}={text!r} contains a newline, carriage return or NUL, which would end its "
            f"#SBATCH line (and could start another); remove it"
        )


def parse_extra(extra: str | Sequence[str] | Mapping[str, Any], name: str, prefix: str = "") -> (
    tuple[str, ...]
):  # fmt: skip
    """SBATCH_EXTRA as --name[=value] words: long options of sbatch that vitpod does not set."""
    if isinstance(extra, Mapping):
        words: list[str] = []
        for key, value in extra.items():
            option = "--" + str(key).removeprefix("--").replace("_", "-")
            if value is not True:
                _check_text(name, str(value))
            words.append(option if value is True else f"{option}={value}")
    elif isinstance(extra, str):
        _check_text(name, extra)
        if not extra.strip():
            if not extra:
                return ()
            raise ConfigError(f"{name}={extra!r} is blank; give sbatch options "
                              f"(e.g. {name}=--mail-type=END) or leave {name} unset")  # fmt: skip
        try:
            words = shlex.split(extra)
        except ValueError as exc:
            raise ConfigError(f"{name}={extra!r}: {exc}; quote a value with blanks as "
                              f"{name}=\"--comment='two words'\"") from None  # fmt: skip
    else:
        words = [str(w) for w in extra]
    out: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(words):
        word = words[i]
        _check_text(name, word)
        if not word.startswith("--") or word == "--":
            raise ConfigError(
                f"{name}: {word!r} is not a long sbatch option; write each as --name=value "
                f'(e.g. {name}="--mail-type=END --mail-user=me@example.org")'
            )
        option, eq, value = word[2:].partition("=")
        kind = _known(option, name, prefix)
        if option in seen:
            raise ConfigError(f"{name}: --{option} is given twice; keep one")
        seen.add(option)
        if not eq and kind == "value":
            if i + 1 >= len(words) or words[i + 1].startswith("-"):
                raise ConfigError(f"{name}: --{option} needs a value; write --{option}=VALUE")
            i, value, eq = i + 1, words[i + 1], "="
        if eq and kind == "none":
            raise ConfigError(f"{name}: --{option} takes no value; write --{option} alone")
        if eq and (not value.strip() or any(c in value for c in '"\\')):
            raise ConfigError(
                f"{name}: --{option}={value!r}: a value must be non-blank and hold no double "
                f"quote or backslash (sbatch reads those in an #SBATCH line); change it"
            )
        if option in ("nodelist", "exclude") and "/" not in value:  # '/': a file of names
            _check_hostlist(f"{name} --{option}", value)
        out.append(f"--{option}={value}" if eq else f"--{option}")
        i += 1
    return tuple(out)


def _known(option: str, name: str, prefix: str) -> Arg:
    if option in OWNED:
        fix = OWNED[option].format(p=prefix)
        use = f"use {fix}" if fix.endswith("=") else f"vitpod sets it: {fix}"
        raise ConfigError(f"{name}: --{option} is not passed through; {use}")
    if option not in SBATCH_OPTIONS:
        near = difflib.get_close_matches(option, list(SBATCH_OPTIONS), n=1)
        hint = f"; did you mean --{near[0]}?" if near else " (see `man sbatch`)"
        raise ConfigError(f"{name}: --{option} is not an sbatch option{hint}")
    return SBATCH_OPTIONS[option]


def excluding(opts: SbatchOptions, nodes: Sequence[str]) -> SbatchOptions:
    """EXCLUDE plus `nodes` (the doctor's bad nodes), so the rendered script excludes them."""
    merged = ",".join(filter(None, [str(opts.exclude), *nodes]))
    return dataclasses.replace(opts, exclude=merged)


def apply(spec: JobSpec, sbatch: Sbatch) -> JobSpec:
    """The JobSpec with the checked options (account and qos over the profile's)."""
    return dataclasses.replace(
        spec, account=sbatch.account or spec.account, qos=sbatch.qos or spec.qos,
        reservation=sbatch.reservation, constraint=sbatch.constraint, exclude=sbatch.exclude,
        sbatch_extra=sbatch.extra, sbatch_set_by=dict(sbatch.set_by),
    )  # fmt: skip


def add_flags(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """--time, --account ... --sbatch-extra (prefix 'finetune-': a pipeline's FT_...
    variables): every command that submits takes them from here, so TIME= reaches each of its
    jobs' #SBATCH --time (a job with a fixed limit of its own says so in its help)."""
    ft = "FT_" if prefix else ""
    parser.add_argument(
        f"--{prefix}time",
        default="",
        help=f"Slurm time limit (default: the stage partition's; make {ft}TIME=)",
    )
    for field in FIELDS:
        what = f"sbatch --{field}" if field != "extra" else "more sbatch long options, shell-quoted"
        parser.add_argument(f"--{prefix}{_flag(field)}", default="",
                            help=f"{what} (make {ft}{VARIABLES[field]}=)")  # fmt: skip


def _flag(field: str) -> str:
    return "sbatch-extra" if field == "extra" else field


def from_namespace(ns: argparse.Namespace, prefix: str = "") -> SbatchOptions:
    """add_flags' values as options whose errors name the make variables."""
    attr = prefix.replace("-", "_")
    ft = "FT_" if prefix else ""
    return SbatchOptions(
        **{f: getattr(ns, attr + _flag(f).replace("-", "_")) for f in FIELDS},
        names={f: ft + VARIABLES[f] for f in FIELDS},
    )
