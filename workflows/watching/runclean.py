"""`vitpod clean`: delete old or ended runs, pipelines and studies under the run root.

Safe by default: `plan` decides and `delete` acts only on what `plan` marked, so the CLI prints
what it would delete (with sizes) and deletes only with --yes. Kept whatever the filters say:
an entry whose jobs Slurm still holds, or whose state nobody can tell (squeue did not answer);
one holding a final model (unless include_finals); and one that a kept entry's records name (the
run a queued fine-tune reads its weights from, a teacher): a pipeline's own stages live inside
its directory, so a queued stage keeps its whole pipeline.
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
from vitpod.workflows.submit import jobstate
from vitpod.workflows.watching import jobctl

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
UNREADABLE = "UNREADABLE"
ENDED = jobstate.TERMINAL | {jobstate.GONE, "NOT_SUBMITTED", "RENDERED", "EMPTY"}
"""States whose jobs Slurm no longer holds (or never held): the ones clean may delete."""


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
) -> tuple[list[Verdict], str]:
    """What clean would do with each entry under `root` older than `older_than` and in one of
    `state` (both filters when both are given); and a note when squeue did not answer."""
    if not older_than.strip() and not state.strip():
        raise ConfigError("vitpod clean: name what to delete: --older-than 7d and/or --state "
                          "FAILED,CANCELLED (`vitpod list` shows ages and states)")  # fmt: skip
    max_age = parse_age(older_than) if older_than.strip() else None
    wanted = parse_states(state)
    entries = jobctl.discover(Path(root))
    note = jobctl.settle(entries)
    now = time.time() if now is None else now
    verdicts = []
    for entry in entries:
        if max_age is not None and now - entry.created < max_age:
            continue
        if wanted and entry.state not in wanted:
            continue
        verdict = Verdict(entry, size_of(entry.path), delete=False)
        final = _has_final(entry)
        if entry.state == UNREADABLE and UNREADABLE not in wanted:
            verdict.reason = f"unreadable record ({entry.note}); --state {UNREADABLE} deletes it"
        elif entry.state == jobctl.UNKNOWN:
            verdict.reason = "squeue did not answer: its jobs may still run"
        elif entry.state not in ENDED | {UNREADABLE}:
            verdict.reason = f"its jobs are {entry.state}: `vitpod cancel` it first"
        elif final is not None and not include_finals:
            verdict.reason = f"holds a final model ({final}); --include-finals deletes it"
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
        if path.is_symlink() or path.parent not in (root, root / jobctl.STUDIES):
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
