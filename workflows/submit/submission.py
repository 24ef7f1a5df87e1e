"""The one path from a plan to Slurm: `materialize` writes the run directory (the script Slurm
will run, bind.sh, plan.json, manifest.json and the sha256 of each rendered file), `submit`
sbatches that kept script, records the job id in the run's record and returns a Job. Every
command that submits goes through `submit` (a stage, a pipeline's stages, a token-label array, a
study and its report job, a calibration, the doctor's jobs, a resume, a rendered run handed to
`vitpod submit RUN_DIR`), so what Slurm runs is byte for byte the file under review: options
decided at submission (a pipeline's afterok on the job before it) go on sbatch's command line,
never into the script. The checks before it are workflows/planning/preflight.py."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import write_decision
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.rundir import create_run_dir, remove_run_dir, write_atomic, write_record
from vitpod.workflows.planning.plan import JobPlan, Request


class SbatchUnanswered(ConfigError):
    """sbatch timed out: the controller may have queued the job without our hearing back."""


@dataclasses.dataclass(frozen=True)
class Job:
    """A submitted job: its id, the kept script Slurm runs and the cluster it went to ('' the
    default one). `state` asks Slurm (squeue, then sacct), `cancel` scancels it."""

    job_id: str
    script: Path
    cluster: str = ""

    @property
    def state(self) -> str:
        with slurm.on_cluster(self.cluster):
            return jobstate.poll_once([self.job_id])[self.job_id].state

    def cancel(self) -> None:
        with slurm.on_cluster(self.cluster):
            slurm.scancel([self.job_id])


# --------------------------------------------------------------------------- the run directory


def request_record(req: Request) -> dict[str, Any]:
    """The request a run was planned from, as manifest.json keeps it (`request`): what
    `vitpod submit RUN_DIR` plans again to run the preflight against the live cluster."""
    record = dataclasses.asdict(dataclasses.replace(req, slurm=type(req.slurm)()))
    record.update(run_dir=str(req.run_dir) if req.run_dir else None, slurm={
        **{k: v if isinstance(v, str) else list(_words(v)) for k, v in req.slurm.given().items()},
        "names": dict(req.slurm.names),
    })  # fmt: skip
    return record


def _words(extra: Any) -> tuple[str, ...]:
    from vitpod.workflows.planning.sbatchopts import parse_extra

    return parse_extra(extra, "SBATCH_EXTRA")


def request_from_record(record: Mapping[str, Any], **changes: Any) -> Request:
    """The Request `request_record` wrote, with `changes` (offline=False for a submission)."""
    from vitpod.workflows.planning.sbatchopts import SbatchOptions

    values = dict(record)
    slurm_opts = dict(values.pop("slurm", {}) or {})
    names = slurm_opts.pop("names", {})
    values["slurm"] = SbatchOptions(**slurm_opts, names=names)
    values["run_dir"] = Path(values["run_dir"]) if values.get("run_dir") else None
    known = {f.name for f in dataclasses.fields(Request)}
    return Request(**{k: v for k, v in {**values, **changes}.items() if k in known})


def materialize(
    plan: JobPlan, manifest: dict[str, Any] | None = None, *, existing: bool = False
) -> Path:
    """Write the run directory: the script, bind.sh, plan.json, manifest.json (with the
    request) and rendered.sha256; nothing is left on failure. `existing`: into a run directory
    that is already there (`vitpod resume`, whose old files were archived first)."""
    run_dir = plan.run_dir
    if not existing:
        create_run_dir(run_dir)
    try:
        write_atomic(plan.script_path, plan.script, mode=0o750)
        written = [plan.script_path]
        if plan.profile.scheduler == "slurm":
            written.append(plan.launch.write_bind_script())
        if plan.decision is not None:
            write_decision(run_dir, plan.decision)
            written.append(run_dir / runfiles.PLAN)
        record = manifest or plan.manifest()
        record = {**record, "request": request_record(plan.request)}
        write_record(run_dir, runfiles.MANIFEST, record)
        record_checksums(run_dir, written)
    except BaseException:
        if not existing:
            remove_run_dir(run_dir)
        raise
    return plan.script_path


# --------------------------------------------------------------------------- what was rendered


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_checksums(directory: Path, files: Iterable[Path]) -> None:
    """rendered.sha256 in `directory`: one `HEX  NAME` line per rendered file (sha256sum's
    format, so `sha256sum -c rendered.sha256` checks it too)."""
    lines = [f"{_sha256(p)}  {p.relative_to(directory)}\n" for p in files]
    write_atomic(directory / runfiles.RENDERED, "".join(lines))


def changed_since_rendering(directory: Path) -> list[str]:
    """What keeps the rendered files of `directory` from being submitted as reviewed: a file
    changed or removed since rendering (named), a manifest.json naming a script that was not
    rendered (manifest.json is not checksummed: its `script` is what sbatch gets), or no
    rendered.sha256 at all; [] when none."""
    sums = directory / runfiles.RENDERED
    if not sums.is_file():
        return [f"{sums} is missing: {directory} was not rendered by this vitpod (or the file "
                "was removed); render it again"]  # fmt: skip
    problems: list[str] = []
    names: list[str] = []
    try:
        script = runfiles.read_manifest(directory).get("script")
    except (OSError, ValueError):
        script = None  # no manifest to submit from: nothing it names
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        names.append(name)
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} was rendered but is gone")
        elif _sha256(path) != digest:
            problems.append(f"{path} changed since it was rendered (sha256 {digest[:12]} then)")
    if script is not None and script not in names:
        problems.append(f"{directory / runfiles.MANIFEST} names script {script!r}, which was "
                        f"not rendered (rendered: {', '.join(names)})")  # fmt: skip
    return problems


def refuse_changed(directories: Iterable[Path]) -> None:
    """ConfigError naming every rendered file changed since rendering, before any submission."""
    problems = [p for d in directories for p in changed_since_rendering(d)]
    if problems:
        raise ConfigError(
            "; ".join(problems) + ". What is submitted is what was rendered and reviewed: "
            "render again (make render / make pipeline OFFLINE=1) and review the new files"
        )


# --------------------------------------------------------------------------- sbatch


def sbatch(script: Path, extra: Sequence[str] = ()) -> str:
    """`sbatch --parsable [EXTRA] SCRIPT` from the script's directory; returns the job id."""
    try:
        return slurm.sbatch(script, extra)
    except slurm.SlurmUnanswered as exc:
        name = _job_name(script)
        raise SbatchUnanswered(
            f"{exc}: the job may be queued anyway; check with `squeue --me --name {name}` (or "
            f"`sacct --name {name}`) before submitting again; {script.parent} is kept"
        ) from None


def _job_name(script: Path) -> str:
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH --job-name="):
            return line.split("=", 1)[1].strip()
    return script.parent.name


def submit(
    script: Path,
    record: Mapping[str, Any],
    *,
    record_name: str = runfiles.MANIFEST,
    id_key: str = "job_ids",
    dependency: str = "",
    cluster: str = "",
    remove_on_refusal: bool = False,
) -> Job:
    """sbatch the kept `script` as it is on disk (after checking it against rendered.sha256),
    then write `record` with the job id into its directory's `record_name` (manifest.json:
    `job_ids`; a study's study.json: `job_id`). `dependency` goes on sbatch's command
    line (which wins over #SBATCH lines), so the script stays the one rendered; the manifest's
    `resolved.dependency` records it. `remove_on_refusal`: a run directory written just now is
    removed when sbatch refuses the job (not after a timeout: the job may be queued)."""
    directory = script.parent
    if (directory / runfiles.RENDERED).is_file():
        refuse_changed([directory])
    options = [f"--dependency={dependency}"] if dependency else []
    try:
        with slurm.on_cluster(cluster or slurm.current_cluster()):
            job_id = sbatch(script, options)
    except SbatchUnanswered:
        raise
    except ConfigError:
        if remove_on_refusal:
            remove_run_dir(directory)
        raise
    written = dict(record)
    written[id_key] = [job_id] if id_key == "job_ids" else job_id
    if dependency and isinstance(written.get("resolved"), dict):
        written["resolved"] = {**written["resolved"], "dependency": dependency}
    write_record(directory, record_name, written)
    return Job(job_id, script, cluster)


def submit_plan(plan: JobPlan, checks: list[str] | None = None) -> Job:
    """A planned (and preflighted) job into a new run directory and into sbatch: the one
    `materialize, sbatch, record` of a single job."""
    manifest = plan.manifest(preflight=checks) if checks is not None else plan.manifest()
    script = materialize(plan, manifest)
    manifest = runfiles.read_manifest(script.parent)
    return submit(script, manifest, cluster=plan.profile.cluster or "", remove_on_refusal=True)
