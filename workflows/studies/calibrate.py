"""`make calibrate CLUSTER=...`: time collectives on the partition's nodes, fit the cost model,
store the fit beside the profile.

One Slurm job (the usual rendered script and bind.sh, entry `commbench`) runs
`python -m vitpod.trainer.engines.commbench` on every rank; this command waits for it, fits latency
and bandwidth per level with `vitpod.analysis.calibrate.fit`, and writes
`<profile>.calibration.json` beside the profile file (bundled profiles:
workflows/profiles/<name>.calibration.json) with the date, the job id and the raw points. Exchange
decisions (`vitpod.workflows.planning.exchange.decide`) and scaling studies use it from then on and
say so. The fit's path is the last line printed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from vitpod.analysis import calibrate as fitting
from vitpod.registry import runfiles
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.rundir import new_run_path, runs_root
from vitpod.workflows.planning import preflight, sbatchopts
from vitpod.workflows.planning.flags import request_flags
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.planning.spec import COMMBENCH_OUT
from vitpod.workflows.site.profile import load_profile, profile_path
from vitpod.workflows.submit.submission import submit_plan

BENCH_MODEL = "volo_tiny"  # the planner wants a recipe; the benchmark ignores it
WAIT_S = 900.0  # how long to wait for the job when --timeout is not given


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vitpod.workflows calibrate", description=__doc__,
        parents=[request_flags("cluster", "nodes", "stage", "args", "run-root", "timeout",
                               cluster="a Slurm profile name or YAML path",
                               nodes="nodes to measure (default: the profile's)",
                               stage="whose partition to measure",
                               args="more vitpod.trainer.engines.commbench flags ('--busy-ms 0')",
                               run_root="parent of calibrations/ (or $VITPOD_RUN_ROOT)",
                               timeout=f"seconds to wait for the job (default {WAIT_S:.0f})")],
    )  # fmt: skip
    p.add_argument("--sizes", default="", help="message sizes, e.g. '4K 64K 1M 16M'")
    p.add_argument("--iters", default="", help="timed calls per size (default 10)")
    p.add_argument("--out", default="", help="where to store the fit (default: beside the profile)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="preflight the benchmark job, print its script; write nothing",
    )
    sbatchopts.add_flags(p)
    return p


def bench_args(ns: argparse.Namespace) -> str:
    """The benchmark's own flags, passed through build_spec's ARGS."""
    args = []
    if ns.sizes:
        args += ["--sizes", ns.sizes]
    if ns.iters:
        args += ["--iters", str(ns.iters)]
    return " ".join(filter(None, [shlex.join(args), ns.args]))


def prepare(ns: argparse.Namespace) -> tuple[JobPlan, Path]:
    """The benchmark job, planned and rendered in memory, and where the fit will go."""
    profile = load_profile(ns.cluster)
    if profile.scheduler != "slurm":
        raise ConfigError(
            f"CLUSTER={profile.name}: calibration runs as a Slurm job over the partition's "
            "nodes; use a Slurm profile (CLUSTER=localslurm for the local test cluster)"
        )
    model = profile.model_for(fallback=BENCH_MODEL)
    run_dir = new_run_path(runs_root(profile, ns.run_root) / "calibrations", "commbench", ns.stage)
    plan = plan_job(
        Request(
            cluster=ns.cluster, model=model, stage=ns.stage, nodes=ns.nodes,
            args=bench_args(ns), run_root=ns.run_root, run_dir=run_dir, entry="commbench",
            time=ns.time, slurm=sbatchopts.from_namespace(ns),
        )
    )  # fmt: skip
    default = fitting.calibration_path(profile_path(ns.cluster))
    out = Path(ns.out).expanduser() if ns.out else default
    return plan, out.absolute()


def submit(plan: JobPlan) -> tuple[Path, str]:
    """Create the run directory (script, bind.sh, manifest) and sbatch it; (run dir, job id)."""
    checks = preflight.check(plan, render_hint="(calibration needs a Slurm login node)")
    job = submit_plan(plan, checks)
    return job.script.parent, job.job_id


def wait(job_id: str, run_dir: Path, timeout: float) -> None:
    """Until the job completes; a failed job raises with the end of its logs."""
    try:
        jobstate.wait_jobs(jobstate.JobStatePoller([job_id]), timeout=timeout, poll_s=2.0)
    except (jobstate.JobFailedError, TimeoutError) as exc:
        tails = [
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted((run_dir / runfiles.LOGS).glob("*.log"))
        ]
        raise RuntimeError(f"calibration job {job_id}: {exc}\n" + "\n".join(tails)) from None


def fit_and_store(
    run_dir: Path, profile_name: str, nics_per_node: int, out: Path, partition: str = ""
) -> Path:
    """Fit the job's benchmark file and store the fit at `out`; returns the path."""
    bench_file = run_dir / COMMBENCH_OUT
    if not bench_file.is_file():
        raise RuntimeError(f"{bench_file} was not written; see {run_dir / runfiles.LOGS}")
    bench = json.loads(bench_file.read_text())
    cal = fitting.fit(bench, cluster=profile_name, nics_per_node=nics_per_node, partition=partition)
    print("\n".join(fitting.summary(cal)))
    return fitting.save(cal, out)


def run(ns: argparse.Namespace) -> Path:
    """Submit, wait, fit, store: the whole command as a function (tests call it)."""
    plan, out = prepare(ns)
    run_dir, job_id = submit(plan)
    spec = plan.spec
    print(f"calibration job {job_id}: {spec.nodes} node(s) x {spec.tasks_per_node} rank(s) of "
          f"partition {spec.partition}, run directory {run_dir}", flush=True)  # fmt: skip
    wait(job_id, run_dir, WAIT_S if ns.timeout is None else ns.timeout)
    nics = int(spec.profile.node_type(ns.stage).fabric.get("nics_per_node", 1))
    return fit_and_store(run_dir, spec.profile.name, nics, out, spec.partition)


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.dry_run:
        plan, out = prepare(ns)
        for line in preflight.check(plan, render_hint="(calibration needs a Slurm login node)"):
            print(f"ok: {line}")
        print(f"# dry run: would write {plan.script_path}, submit it and store the fit at {out}; "
              "nothing written or submitted")  # fmt: skip
        print(plan.script, end="" if plan.script.endswith("\n") else "\n")
        return 0
    try:
        path = run(ns)
    except (RuntimeError, fitting.CalibrationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
