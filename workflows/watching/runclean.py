"""`vitpod clean`: delete old or ended runs, pipelines and studies under the run root.

Safe by default: `plan` decides and `delete` acts only on what `plan` marked, so the CLI prints
what it would delete (with sizes) and deletes only with --yes. Kept whatever the filters say:
an entry whose jobs Slurm still holds, or whose state nobody can tell (squeue did not answer);
one a process on this host still names (a local run's ranks: no Slurm knows them); one holding a
final model (unless include_finals) or set-aside checkpoints (checkpoints/discarded/, unless
include_discarded); and one that a kept entry's records name (the run a queued fine-tune reads
its weights from, a teacher): a pipeline's own stages live inside its directory, so a queued
stage keeps its whole pipeline. Only a directory that holds vitpod's own record (`foreign` says
how that is told) directly under the run root or its studies/, reached through no link, is ever
deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.watching import jobctl

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
UNREADABLE = "UNREADABLE"
ENDED = jobstate.TERMINAL | {jobstate.GONE, "NOT_SUBMITTED", "RENDERED", "EMPTY"}
"""States whose jobs Slurm no longer holds (or never held): the ones clean may delete."""
RUN_NAME = re.compile(r"\d{8}T\d{6}Z-.+-[0-9a-f]{6}")
"""How vitpod names what it creates under the run root (rundir.new_run_path)."""


@dataclass
class Verdict:
    """One entry the filters matched: deleted, or kept and why."""

    entry: jobctl.Entry
    size: int
    delete: bool
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**self.entry.as_dict(), "size_bytes": self.size, "delete": self.delete,
                "reason": self.reason}  # fmt: skip


def parse_age(text: str) -> float:
    """'7d', '12h', '30m', '2w', '90s' -> seconds."""
    match = _AGE.match(text.strip().lower())
    if not match:
        raise ConfigError(f"--older-than {text!r}: write a number and a unit, e.g. 7d, 12h or "
                          f"30m (units: {', '.join(AGE_UNITS)})")  # fmt: skip
    return float(match[1]) * AGE_UNITS[match[2]]


def parse_states(text: str) -> set[str]:
    """--state FAILED,cancelled -> {"FAILED", "CANCELLED"}; a live state is refused."""
    wanted = {s.strip().upper() for s in text.split(",") if s.strip()}
    allowed = ENDED | {UNREADABLE}
    bad = sorted(wanted - allowed)
    if bad:
        raise ConfigError(f"--state {','.join(bad)}: clean deletes only ended runs; choose "
                          f"from {','.join(sorted(allowed))} (`vitpod cancel` a live run "
                          "first)")  # fmt: skip
    return wanted


def size_of(path: Path) -> int:
    """Bytes under `path` (links not followed)."""
    total = 0
    for top, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _has_final(entry: jobctl.Entry) -> Path | None:
    for part in entry.parts:
        final = part.run_dir / runfiles.FINAL if part.run_dir else None
        if final is not None and final.is_dir() and any(final.iterdir()):
            return final
    return None


def _discarded(entry: jobctl.Entry) -> Path | None:
    for part in entry.parts:
        folder = (
            part.run_dir / runfiles.CHECKPOINTS / runfiles.CHECKPOINT_DISCARDED
            if part.run_dir
            else None
        )
        if folder is not None and folder.is_dir() and any(folder.iterdir()):
            return folder
    return None


def foreign(entry: jobctl.Entry) -> str | None:
    """Why `entry` is not a directory vitpod made (None: it is). A run's manifest records its
    own directory (resolved.run_dir, whose name is this one's even after the run root moved);
    a pipeline's record lists its stages, a study's its points; a record that cannot be read
    counts only under the name vitpod gives what it creates."""
    path = entry.path
    if entry.state == UNREADABLE:
        if RUN_NAME.fullmatch(path.name):
            return None
        return "its record is unreadable and its name is not one vitpod gives"
    record = {"run": runfiles.MANIFEST, "pipeline": runfiles.PIPELINE, "study": runfiles.STUDY}
    try:
        data = runfiles.read_json(path / record[entry.kind])
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        return f"{record[entry.kind]} is not vitpod's"
    if entry.kind == "run":
        recorded = (data.get("resolved") or {}).get("run_dir")
        ok = isinstance(recorded, str) and Path(recorded).name == path.name
    else:
        ok = isinstance(data.get("stages" if entry.kind == "pipeline" else "points"), (dict, list))
    return None if ok else f"its {record[entry.kind]} is not a record vitpod wrote for it"


def _linked(root: Path, path: Path) -> bool:
    """Whether `path` is reached from `root` through a symbolic link (itself, or studies/)."""
    return path.is_symlink() or (path.parent != root and path.parent.is_symlink())


def _processes() -> dict[int, list[str]]:
    """Every process on this host that can be read: pid -> its arguments."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            found[int(proc.name)] = [a for a in argv if a]
        except (OSError, ValueError):
            continue
    return found


def _live_process(entry: jobctl.Entry, processes: dict[int, list[str]]) -> str | None:
    """A process on this host with an argument in the entry's directory (a local run's ranks
    and launcher: `--output RUN`, `--plan RUN/plan.json`, `bash RUN/job.sh`): 'pid N (argv)'."""
    names = {str(entry.path), os.path.realpath(entry.path)}
    for pid, argv in processes.items():
        if pid != os.getpid() and any(_within(a, n) for a in argv for n in names):
            return f"pid {pid} ({' '.join(argv)[:100]})"
    return None


def _within(arg: str, path: str) -> bool:
    """`arg` is `path` or below it, alone or as a --flag=VALUE's value."""
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    return value == path or value.startswith(path + "/")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _named_paths(entry: jobctl.Entry) -> set[Path]:
    """Every absolute path the entry's records name (its manifests, pipeline.json, study.json):
    --finetune sources, teachers, label folders, its own run directories."""
    records = [entry.path / runfiles.PIPELINE, entry.path / runfiles.STUDY]
    for part in entry.parts:
        if part.run_dir is not None:
            records += [part.run_dir / runfiles.MANIFEST,
                        *part.run_dir.glob("manifest.restart*.json")]  # fmt: skip
    paths = set()
    for record in records:
        try:
            data = runfiles.read_json(record)
        except (OSError, ValueError):
            continue
        for text in _strings(data):
            for token in re.split(r"[\s=,:]+", text):
                if token.startswith("/"):
                    paths.add(Path(os.path.normpath(token)))
    return paths


def _names(paths: set[Path], target: Path) -> bool:
    return any(p == target or target in p.parents for p in paths)


def plan(
    root: Path,
    older_than: str = "",
    state: str = "",
    include_finals: bool = False,
    now: float | None = None,
    include_discarded: bool = False,
) -> tuple[list[Verdict], str]:
    """What clean would do with each entry under `root` older than `older_than` and in one of
    `state` (both filters when both are given); and a note when squeue did not answer."""
    if not older_than.strip() and not state.strip():
        raise ConfigError("vitpod clean: name what to delete: --older-than 7d and/or --state "
                          "FAILED,CANCELLED (`vitpod list` shows ages and states)")  # fmt: skip
    max_age = parse_age(older_than) if older_than.strip() else None
    wanted = parse_states(state)
    root = Path(root).absolute()
    entries = jobctl.discover(root)
    note = jobctl.settle(entries)
    now = time.time() if now is None else now
    processes = _processes()
    verdicts = []
    for entry in entries:
        if max_age is not None and now - entry.created < max_age:
            continue
        if wanted and entry.state not in wanted:
            continue
        verdict = Verdict(entry, size_of(entry.path), delete=False)
        final, discarded = _has_final(entry), _discarded(entry)
        not_ours, live = foreign(entry), _live_process(entry, processes)
        if _linked(root, entry.path):
            verdict.reason = f"reached through a symbolic link: not under {root}"
        elif not_ours:
            verdict.reason = f"{not_ours}; delete it by hand if it is yours"
        elif live:
            verdict.reason = f"a process on this host uses it: {live}; stop it first"
        elif entry.state == UNREADABLE and UNREADABLE not in wanted:
            verdict.reason = f"unreadable record ({entry.note}); --state {UNREADABLE} deletes it"
        elif entry.state == jobctl.UNKNOWN:
            verdict.reason = "squeue did not answer: its jobs may still run"
        elif entry.state not in ENDED | {UNREADABLE}:
            verdict.reason = f"its jobs are {entry.state}: `vitpod cancel` it first"
        elif final is not None and not include_finals:
            verdict.reason = f"holds a final model ({final}); --include-finals deletes it"
        elif discarded is not None and not include_discarded:
            verdict.reason = (
                f"holds set-aside checkpoints ({discarded}); --include-discarded deletes them"
            )
        else:
            verdict.delete = True
        verdicts.append(verdict)
    _keep_named(entries, verdicts)
    return verdicts, note


def _keep_named(entries: list[jobctl.Entry], verdicts: list[Verdict]) -> None:
    """Keep what a kept entry names, until nothing changes (a kept fine-tune keeps its
    pretrain, which keeps its teacher)."""
    doomed = {v.entry.path: v for v in verdicts if v.delete}
    named = {e.path: _named_paths(e) for e in entries}
    changed = True
    while changed:
        changed = False
        for entry in entries:
            if entry.path in doomed:
                continue
            for path, verdict in list(doomed.items()):
                if path != entry.path and _names(named[entry.path], path):
                    verdict.delete = False
                    verdict.reason = f"{entry.path} (kept) reads from it"
                    del doomed[path]
                    changed = True


def delete(root: Path, verdicts: list[Verdict]) -> int:
    """Remove the entries `plan` marked; returns the bytes freed. Only directories directly
    under `root` or root/studies, never through a link."""
    root = Path(root).absolute()
    freed = 0
    for verdict in verdicts:
        path = verdict.entry.path
        if not verdict.delete:
            continue
        if _linked(root, path) or path.parent not in (root, root / jobctl.STUDIES):
            raise ConfigError(f"{path}: not a directory under {root}; nothing deleted there")
        shutil.rmtree(path)
        freed += verdict.size
    return freed


def format_verdicts(verdicts: list[Verdict]) -> str:
    rows = [("ACTION", "STATE", "KIND", "AGE", "SIZE", "PATH")]
    rows += [("delete" if v.delete else "keep", v.entry.state, v.entry.kind, v.entry.age(),
              human(v.size), f"{v.entry.path}" + ("" if v.delete else f"  ({v.reason})"))
             for v in verdicts]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows
    )


def dumps(verdicts: list[Verdict]) -> str:
    return json.dumps([v.as_dict() for v in verdicts], indent=2)
