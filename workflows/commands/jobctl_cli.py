"""`vitpod list` and `vitpod cancel RUN` (make list, make cancel RUN=...):
workflows/watching/jobctl.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.rundir import RUN_ROOT_ENV, runs_root
from vitpod.workflows.watching import jobctl

DEFAULT_CLUSTER = "local"  # the Makefile's CLUSTER default


def list_root(run_root: str, cluster: str) -> Path:
    """--run-root, else $VITPOD_RUN_ROOT, else the storage.runs of --cluster's profile (local)."""
    if run_root or os.environ.get(RUN_ROOT_ENV):
        return Path(run_root or os.environ[RUN_ROOT_ENV]).expanduser().absolute()
    from vitpod.workflows.site.profile import load_profile

    return runs_root(load_profile(cluster or DEFAULT_CLUSTER))


def list_roots(run_root: str, cluster: str) -> tuple[list[Path], list[str]]:
    """Where `vitpod list` looks: --run-root, $VITPOD_RUN_ROOT or --cluster's storage.runs when
    given; else the storage.runs of every known profile (bundled and $VITPOD_PROFILES), each
    once. Also a line for each root that is not here and each profile that does not load."""
    if run_root or cluster or os.environ.get(RUN_ROOT_ENV):
        return [list_root(run_root, cluster)], []
    from vitpod.workflows.site.profile import known_profiles, load_profile

    roots: dict[Path, list[str]] = {}
    skipped = []
    for name in known_profiles():
        try:
            roots.setdefault(runs_root(load_profile(name)), []).append(name)
        except ConfigError as exc:
            skipped.append(f"profile {name} not read: {exc}")
    here = [r for r in roots if r.is_dir()]
    skipped += [f"{r} ({', '.join(n)}): no such directory here" for r, n in roots.items()
                if r not in here]  # fmt: skip
    return here, skipped


def list_main(argv: list[str]) -> int:
    """Runs, pipelines and studies under the run root: state, job ids, progress, age."""
    p = argparse.ArgumentParser(prog="vitpod list", description=list_main.__doc__)
    p.add_argument(
        "--state", default="", help="only these states, comma-separated (RUNNING,PENDING)"
    )
    p.add_argument("--model", default="", help="only runs of this model")
    p.add_argument(
        "--cluster", default="",
        help="only runs of this profile; its storage.runs is the run root unless --run-root or "
        f"${RUN_ROOT_ENV} says otherwise (none of them: every known profile's storage.runs)",
    )  # fmt: skip
    p.add_argument("--run-root", default="", help=f"where the runs are (default ${RUN_ROOT_ENV})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = p.parse_args(argv)
    jobctl.parse_states(ns.state)  # a typo is refused before anything is read
    roots, skipped = list_roots(ns.run_root, ns.cluster)
    entries, notes = [], []
    for root in roots:
        found, note = jobctl.list_entries(root, ns.state, ns.model, ns.cluster)
        entries += found
        notes += [note] if note and note not in notes else []
    entries.sort(key=lambda e: e.created)
    where = ", ".join(map(str, roots)) or "none"
    if ns.json:
        print(json.dumps([e.as_dict() for e in entries], indent=2))
    elif entries:
        print(jobctl.format_entries(entries))
    else:
        print(f"no runs under {where}" + (" match" if ns.state or ns.model or ns.cluster else ""))
    if len(roots) != 1 or skipped:
        print(f"searched: {where}" + (f"; not searched: {'; '.join(skipped)}" if skipped else ""),
              file=sys.stderr)  # fmt: skip
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def cancel_main(argv: list[str]) -> int:
    """Cancel every job of a run, pipeline or study, pending and running ones included."""
    p = argparse.ArgumentParser(prog="vitpod cancel", description=cancel_main.__doc__)
    p.add_argument("run", nargs="?", default="", help="run, pipeline or study directory")
    p.add_argument("--run", dest="run_flag", default="", help="the same (make cancel RUN=...)")
    ns = p.parse_args(argv)
    target = ns.run or ns.run_flag
    if not target:
        raise ConfigError("vitpod cancel RUN: name the run, pipeline or study directory "
                          "(`vitpod list` shows them)")  # fmt: skip
    entry, cancelled = jobctl.cancel(Path(target))
    if cancelled:
        jobs = ", ".join(f"{j} ({state})" for j, state in cancelled.items())
        print(f"cancelled {entry.kind} {entry.path}: job(s) {jobs}")
    else:
        known = ",".join(entry.jobs) or "none submitted"
        print(f"nothing to cancel: no job of {entry.kind} {entry.path} is queued or running "
              f"(its jobs: {known})")  # fmt: skip
    print("the directory stays; continue a stopped run with `vitpod resume --run RUN_DIR`")
    return 0


def clean_main(argv: list[str]) -> int:
    """Delete old or ended runs, pipelines and studies under the run root
    (workflows/watching/runclean.py). Prints what it would delete with sizes; deletes only with
    --yes. Keeps live jobs' runs, final models (unless --include-finals) and what a kept run reads
    from."""
    from vitpod.workflows.watching import runclean

    p = argparse.ArgumentParser(prog="vitpod clean", description=clean_main.__doc__)
    p.add_argument("--older-than", default="", help="only entries older than this (7d, 12h, 30m)")
    p.add_argument(
        "--state", default="", help="only these ended states, comma-separated (FAILED,CANCELLED)"
    )
    p.add_argument(
        "--include-finals", action="store_true", help="delete runs that hold a final model too"
    )
    p.add_argument(
        "--include-discarded", action="store_true",
        help="delete runs holding set-aside checkpoints (checkpoints/discarded/) too",
    )  # fmt: skip
    p.add_argument("--yes", action="store_true", help="delete (without it: only print the plan)")
    p.add_argument(
        "--cluster", default="", help="its storage.runs is the run root (unless --run-root)"
    )
    p.add_argument("--run-root", default="", help=f"where the runs are (default ${RUN_ROOT_ENV})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = p.parse_args(argv)
    root = list_root(ns.run_root, ns.cluster)
    verdicts, note = runclean.plan(root, ns.older_than, ns.state, ns.include_finals,
                                   include_discarded=ns.include_discarded)  # fmt: skip
    if note:
        print(f"note: {note}", file=sys.stderr)
    if ns.json:
        print(runclean.dumps(verdicts))
    elif verdicts:
        print(runclean.format_verdicts(verdicts))
    doomed = [v for v in verdicts if v.delete]
    size = runclean.human(sum(v.size for v in doomed))
    if not ns.yes:
        print(f"would delete {len(doomed)} of {len(verdicts)} matching under {root} ({size}); "
              "add --yes (make clean-runs YES=1) to delete", file=sys.stderr)  # fmt: skip
        return 0
    freed = runclean.delete(root, verdicts)
    print(f"deleted {len(doomed)} under {root}, freed {runclean.human(freed)}", file=sys.stderr)
    return 0
