"""Render, review, submit: a run directory written by `make render` (or a pipeline's stage
written with OFFLINE=1) is submitted as it is, after the preflight runs again against the live
cluster and its files are checked against the sha256 recorded when they were rendered
(submission.py). `vitpod submit RUN_DIR` / `make submit RUN=...` (a pipeline directory goes to
Chain.from_dir(...).submit(), workflows/cli.py)."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.rundir import write_record
from vitpod.workflows.planning import preflight
from vitpod.workflows.planning.plan import JobPlan, plan_job
from vitpod.workflows.submit import submission


def manifest_of(run_dir: Path) -> dict[str, Any]:
    try:
        return runfiles.read_manifest(run_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{run_dir}: no readable {runfiles.MANIFEST} ({exc}); pass a run directory that "
            "make render (or make pipeline OFFLINE=1) wrote"
        ) from None


def refuse_submitted(run_dir: Path, manifest: dict[str, Any]) -> None:
    if manifest.get("job_ids"):
        ids = " ".join(map(str, manifest["job_ids"]))
        raise ConfigError(f"{run_dir} was already submitted (job {ids}); to continue it: "
                          f"make resume RUN={run_dir}")  # fmt: skip


def replan(
    run_dir: Path, script_of: Callable[[JobPlan], str] | None = None, **changes: Any
) -> JobPlan:
    """The run planned again from its manifest's request, online, in its own directory; the plan
    carries the kept script (what sbatch --test-only and the submission read). `script_of`: the
    script a plan renders to, when not plan.script (a labeling array's)."""
    manifest = manifest_of(run_dir)
    record = manifest.get("request")
    if not isinstance(record, dict):
        raise ConfigError(f"{run_dir / runfiles.MANIFEST} has no `request` (rendered by an older "
                          "vitpod); render it again")  # fmt: skip
    rendered_in = (manifest.get("resolved") or {}).get("run_dir")
    if rendered_in and Path(rendered_in).resolve() != run_dir.resolve():
        raise ConfigError(f"{run_dir} was rendered as {rendered_in} (its scripts read and write "
                          "there): submit that directory, or render again (make render / make "
                          "pipeline OFFLINE=1)")  # fmt: skip
    recorded = (manifest.get("profile") or {}).get("path")
    cluster = recorded if recorded and Path(recorded).is_file() else record["cluster"]
    req = submission.request_from_record(
        record, cluster=cluster, run_dir=run_dir, offline=False, **changes
    )
    plan = plan_job(req)
    kept = (run_dir / manifest["script"]).read_text()
    if kept != (script_of(plan) if script_of else plan.script):
        print(f"note: planned against the live cluster now, {manifest['script']} would differ "
              f"from the rendered one; submitting the rendered one ({run_dir})")  # fmt: skip
    return dataclasses.replace(plan, script=kept)


def submit_run(path: str | Path, dry_run: bool = False) -> int:
    """`vitpod submit RUN_DIR`: check the rendered files, preflight, sbatch the kept script."""
    run_dir = Path(path).expanduser().absolute()
    manifest = manifest_of(run_dir)
    refuse_submitted(run_dir, manifest)
    submission.refuse_changed([run_dir])
    plan = replan(run_dir)
    checks = preflight.check(plan)
    for line in checks:
        print(f"ok: {line}")
    script = run_dir / manifest["script"]
    if dry_run:
        print(f"# dry run: would submit {script} as rendered; nothing submitted")
        return 0
    manifest["preflight"] = checks
    if plan.profile.scheduler != "slurm":
        write_record(run_dir, runfiles.MANIFEST, manifest)
        return run_here(script, plan.profile.name)
    job = submission.submit(script, manifest, cluster=plan.profile.cluster or "")
    print(f"submitted batch job {job.job_id}")
    print(f"run directory: {run_dir}")
    print(script)
    return 0


def run_here(script: Path, profile: str) -> int:
    """A profile without a scheduler: run the rendered script on this machine, record its exit."""
    print(f"running {script} here (profile {profile} has no scheduler)", flush=True)
    rc = subprocess.run(["bash", str(script)], check=False).returncode
    manifest = runfiles.read_manifest(script.parent)
    write_record(script.parent, runfiles.MANIFEST, {**manifest, "local_exit_status": rc})
    return rc
