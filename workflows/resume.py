"""`vitpod resume`: resubmit a stopped or failed run on another node count, same global batch.

The run is planned again for NODES with the run's global batch (`--global-batch G --elastic`:
-b stays, the accumulation is G / (dp x b)); the previous plan.json, script and manifest are
kept as plan.restart<N>.json, job.restart<N>.sbatch and manifest.restart<N>.json (N = 1, 2, ...
in order of restarts), then the new ones are written and submitted. The trainer resumes the
newest checkpoint from the global sample position (trainer/elastic.py). One job per run: while a
job of the run (any id in its manifests) is still pending, running, requeued or suspended, resume
refuses before writing anything, or with --cancel-running (CANCEL=1) cancels it and waits until
it has left the queue (workflows/runjobs.py).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import write_decision
from vitpod.workflows import preflight, runjobs
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.plan import JobPlan, Request, plan_job
from vitpod.workflows.profile import load_profile
from vitpod.workflows.rundir import write_atomic, write_json
from vitpod.workflows.sbatchopts import SbatchOptions
from vitpod.workflows.submission import sbatch

KEPT = (runfiles.PLAN, runfiles.MANIFEST)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vitpod.workflows resume", description=__doc__)
    p.add_argument("--run", required=True, help="the run directory to continue")
    p.add_argument("--nodes", default="", help="node count of the new job (default: as before)")
    p.add_argument("--dry-run", action="store_true", help="plan and check, write nothing")
    p.add_argument(
        "--cancel-running", action="store_true",
        help="cancel the run's pending or running job first and wait until it has left the queue",
    )  # fmt: skip
    return p


def resume_request(run: Path, nodes: str) -> Request:
    """The run's own request (cluster, stage, model, ARGS) on `nodes`, global batch pinned."""
    manifest = _manifest(run)
    trainer = manifest.get("trainer") or {}
    if "global_batch_size" not in trainer:
        raise ConfigError(f"{run}/manifest.json records no trainer: only training runs resume")
    overrides = manifest["overrides"]
    pinned = f"-b {trainer['batch_size']} --global-batch {trainer['global_batch_size']} --elastic"
    return Request(
        cluster=manifest["profile"]["name"], model=manifest["model"], stage=manifest["stage"],
        nodes=nodes or manifest["resolved"]["nodes"],
        args=f"{overrides.get('args') or ''} {pinned}".strip(),
        finetune_from=overrides.get("finetune_from") or "", run_dir=run,
        slurm=SbatchOptions(**overrides.get("sbatch", {})),
    )  # fmt: skip


def _manifest(run: Path) -> dict[str, Any]:
    try:
        return runfiles.read_manifest(run)
    except (OSError, ValueError) as exc:
        msg = f"{run}: not a run directory with a readable manifest.json ({exc})"
        raise ConfigError(msg) from None


def plan_resume(run: Path, nodes: str) -> JobPlan:
    """The new plan, or ConfigError naming the node counts the global batch splits over."""
    req = resume_request(run, nodes)
    try:
        return plan_job(req)
    except ConfigError as exc:
        if "--elastic" not in str(exc):
            raise
        raise ConfigError(f"{exc}; NODES that work: {_fitting_nodes(req)}") from None


def _fitting_nodes(req: Request) -> str:
    """Node counts of the stage's partition whose data-parallel size splits the global batch."""
    profile = load_profile(req.cluster)
    part, node = profile.partition(req.stage), profile.node_type(req.stage)
    argv = shlex.split(req.args)
    batch = int(argv[argv.index("--global-batch") + 1]) // int(argv[argv.index("-b") + 1])
    ranks = node.ranks_per_node
    fits = [n for n in range(1, part.node_limit + 1) if batch % (n * ranks) == 0]
    return ", ".join(map(str, fits)) or "none (mind tp x pp)"


def archive(run: Path, script_name: str) -> int:
    """Keep the current plan, script and manifest as <name>.restart<N>.<ext>; returns N."""
    n = 1 + sum(1 for _ in run.glob("plan.restart*.json"))
    for name in (*KEPT, script_name):
        path = run / name
        if path.is_file():
            shutil.copy2(path, run / f"{path.stem}.restart{n}{path.suffix}")
    return n


def write_plan(plan: JobPlan, checks: Any, restart: int) -> Path:
    """The new script, plan.json and manifest over the old ones (already archived)."""
    write_atomic(plan.script_path, plan.script, mode=0o750)
    if plan.profile.scheduler == "slurm":
        plan.launch.write_bind_script()
    if plan.decision is not None:
        write_decision(plan.run_dir, plan.decision)
    write_json(plan.run_dir / runfiles.MANIFEST, plan.manifest(preflight=checks, restart=restart))
    return plan.script_path


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    run = Path(ns.run).expanduser().absolute()
    plan = plan_resume(run, str(ns.nodes))
    checks = preflight.check(plan)
    spec = plan.spec
    size = f"{spec.nodes} node(s) x {spec.tasks_per_node} rank(s)"
    accum = (plan.trainer or {}).get("accum_steps")
    print(f"resume {run} on {size}, accumulation {accum}")
    if plan.profile.scheduler == "slurm":
        runjobs.refuse_or_cancel(
            run, ns.cancel_running and not ns.dry_run, flag="--cancel-running (make CANCEL=1)"
        )
    if ns.dry_run:
        return 0
    restart = archive(run, plan.script_name)
    script = write_plan(plan, checks, restart)
    if plan.profile.scheduler != "slurm":
        print(f"run {script} here to continue (profile {plan.profile.name} has no scheduler)")
        return 0
    job_id = sbatch(script)
    write_json(run / runfiles.MANIFEST, plan.manifest([job_id], preflight=checks, restart=restart))
    print(f"submitted batch job {job_id} (restart {restart}; plan.restart{restart}.json kept)")
    return 0
