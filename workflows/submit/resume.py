"""`vitpod resume`: resubmit a stopped or failed run on another node count, same global batch.

The run is planned again for NODES with the run's global batch (`--global-batch G --elastic`:
-b stays, the accumulation is G / (dp x b)); the previous plan.json, script and manifest are
kept as plan.restart<N>.json, job.restart<N>.sbatch and manifest.restart<N>.json (N = 1, 2, ...
in order of restarts), then the new ones are written and submitted (workflows/submit/submission.py,
as every submission). The trainer resumes the
newest checkpoint from the global sample position (trainer/checkpointing/elastic.py). One job per
run: while a job of the run (any id in its manifests) is still pending, running, requeued or
suspended, resume refuses before writing anything, or with --cancel-running (CANCEL=1) cancels it
and waits until it has left the queue (workflows/jobs/runjobs.py).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision, RecordError, read_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import runjobs
from vitpod.workflows.planning import noderange, preflight, sbatchopts
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.planning.sbatchopts import SbatchOptions
from vitpod.workflows.site.profile import load_profile
from vitpod.workflows.submit.submission import materialize, submit
from vitpod.workflows.watching.hangs import excluded_nodes

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
    sbatchopts.add_flags(p)  # TIME=, ACCOUNT=, ...: win over the run's own
    return p


def resume_request(
    run: Path, nodes: str, given: SbatchOptions | None = None, time: str = ""
) -> Request:
    """The run's own request (cluster, stage, model, ARGS, TIME, sbatch options) on `nodes`,
    global batch pinned; `given` sbatch options and `time` win over the run's."""
    manifest = _manifest(run)
    decision = _decision(run)
    overrides = manifest["overrides"]
    assert decision.trainer is not None and decision.global_batch is not None  # _decision's
    recorded = SbatchOptions(**overrides.get("sbatch", {}))
    pinned = noderange.pinned(decision.trainer.optim["batch_size"], decision.global_batch)
    slurm = given.over(recorded) if given else recorded
    listed = set(str(slurm.exclude).split(","))
    if "/" not in str(slurm.exclude):  # with '/': EXCLUDE names a file of nodes (sbatch)
        # Nodes that hung twice in this run (the watchdog's RUN/exclude-nodes), as a requeue does
        slurm = sbatchopts.excluding(slurm, [n for n in excluded_nodes(run) if n not in listed])
    return Request(
        cluster=_profile(manifest), model=manifest["model"], stage=manifest["stage"],
        nodes=nodes or manifest["resolved"]["nodes"], args=overrides.get("args") or "",
        overrides=pinned, finetune_from=overrides.get("finetune_from") or "", run_dir=run,
        slurm=slurm, time=time or overrides.get("time") or "",
    )  # fmt: skip


def _profile(manifest: dict[str, Any]) -> str:
    """The profile the run was planned with: its file (CLUSTER=FILE, or the bundled one's) while
    it is there, else its name; a bundled profile of the same name is another cluster."""
    recorded = manifest["profile"]
    path = recorded.get("path")
    return str(path) if path and Path(path).is_file() else str(recorded["name"])


def _manifest(run: Path) -> dict[str, Any]:
    try:
        return runfiles.read_manifest(run)
    except (OSError, ValueError) as exc:
        msg = f"{run}: not a run directory with a readable manifest.json ({exc})"
        raise ConfigError(msg) from None


def _decision(run: Path) -> Decision:
    """The run's plan.json: what it trained with (its batch, global batch and layout)."""
    try:
        decision = read_decision(run)
    except RecordError as exc:
        raise ConfigError(str(exc)) from None
    if decision.trainer is None:
        raise ConfigError(f"{run}/plan.json: its ranks ran no trainer; only training runs resume")
    return decision


def plan_resume(
    run: Path, nodes: str, given: SbatchOptions | None = None, time: str = ""
) -> JobPlan:
    """The new plan, or ConfigError naming the node counts the global batch splits over."""
    req = resume_request(run, nodes, given, time)
    try:
        return plan_job(req)
    except ConfigError as exc:
        fits = _fitting_nodes(req, _decision(run))
        if str(req.nodes) in map(str, fits):  # the batch splits: another problem
            raise
        named = ", ".join(map(str, fits)) or "none"
        raise ConfigError(f"{exc}; NODES that work: {named}") from None


def _fitting_nodes(req: Request, decision: Decision) -> list[int]:
    """Node counts of the stage's partition whose data-parallel size splits the global batch."""
    profile = load_profile(req.cluster)
    part, node = profile.partition(req.stage), profile.node_type(req.stage)
    assert decision.trainer is not None and decision.global_batch is not None
    per_rank = decision.global_batch // decision.trainer.optim["batch_size"]
    replica = decision.layout.tp * decision.layout.pp
    worlds = {n: n * node.ranks_per_node for n in range(1, part.node_limit + 1)}
    return [n for n, w in worlds.items() if w % replica == 0 and per_rank % (w // replica) == 0]


def archive(run: Path, script_name: str) -> int:
    """Keep the current plan, script and manifest as <name>.restart<N>.<ext>; returns N."""
    n = 1 + sum(1 for _ in run.glob("plan.restart*.json"))
    for name in (*KEPT, script_name):
        path = run / name
        if path.is_file():
            shutil.copy2(path, run / f"{path.stem}.restart{n}{path.suffix}")
    return n


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    run = Path(ns.run).expanduser().absolute()
    plan = plan_resume(run, str(ns.nodes), sbatchopts.from_namespace(ns), ns.time)
    checks = preflight.check(plan)
    spec = plan.spec
    size = f"{spec.nodes} node(s) x {spec.tasks_per_node} rank(s)"
    accum = (plan.trainer or {}).get("accum_steps")  # the plan's, for this world size
    print(f"resume {run} on {size}, accumulation {accum}")
    if plan.profile.scheduler == "slurm":
        runjobs.refuse_or_cancel(
            run, ns.cancel_running and not ns.dry_run, flag="--cancel-running (make CANCEL=1)"
        )
    if ns.dry_run:
        return 0
    restart = archive(run, plan.script_name)
    script = materialize(plan, plan.manifest(preflight=checks, restart=restart), existing=True)
    if plan.profile.scheduler != "slurm":
        print(f"run {script} here to continue (profile {plan.profile.name} has no scheduler)")
        return 0
    job = submit(script, runfiles.read_manifest(run), cluster=plan.profile.cluster or "")
    print(f"submitted batch job {job.job_id} (restart {restart}; plan.restart{restart}.json kept)")
    return 0
