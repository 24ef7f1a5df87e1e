"""`vitpod <cmd>`: a lazy dispatch table; render, preflight, submit: one planner."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import write_decision
from vitpod.trainer.exitcodes import USAGE
from vitpod.workflows import preflight
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.plan import JobPlan, Request, plan_job
from vitpod.workflows.rundir import (
    RUN_ROOT_ENV,
    create_run_dir,
    remove_run_dir,
    write_atomic,
    write_json,
)
from vitpod.workflows.submission import sbatch_run

# Each command's `main(argv) -> int`, imported only when used, so one area's missing module
# breaks only its own command.
COMMANDS = {
    "render": "vitpod.workflows.cli:render_main",
    "preflight": "vitpod.workflows.cli:preflight_main",
    "submit": "vitpod.workflows.cli:submit_main",
    "pipeline": "vitpod.workflows.pipeline:main",
    "demo": "vitpod.workflows.demo:main",
    "status": "vitpod.workflows.status:main",
    "scaling": "vitpod.workflows.scaling:main",
    "calibrate": "vitpod.workflows.calibrate:main",
    "token-labels": "vitpod.workflows.labels:main",
}


def stage_parser(prog: str) -> argparse.ArgumentParser:
    """Arguments of render/preflight/submit; an empty string (from make) means 'not given'."""
    p = argparse.ArgumentParser(prog=f"python -m vitpod.workflows {prog}")
    p.add_argument("--stage", default="pretrain", choices=("pretrain", "finetune"))
    p.add_argument("--cluster", default="local", help="bundled profile name or a YAML path")
    p.add_argument(
        "--model",
        default="",
        help="recipe name or YAML path (default: the profile's default_model)",
    )
    p.add_argument("--nodes", default="", help="override the stage partition's node count")
    p.add_argument("--args", default="", help="extra trainer flags, shell-quoted")
    p.add_argument("--finetune-from", default="", help="run dir or checkpoint to fine-tune")
    p.add_argument("--dependency", default="", help="sbatch dependency, e.g. afterok:123")
    p.add_argument("--run-root", default="", help=f"override storage.runs (or ${RUN_ROOT_ENV})")
    p.add_argument(
        "--entry",
        default="trainer",
        choices=("trainer", "rankinfo"),
        help="what each rank runs (rankinfo: print rank facts, for cluster checks)",
    )
    return p


def request(ns: argparse.Namespace) -> Request:
    return Request(
        cluster=ns.cluster, model=ns.model, stage=ns.stage, nodes=ns.nodes, args=ns.args,
        finetune_from=ns.finetune_from, dependency=ns.dependency, run_root=ns.run_root,
        entry=ns.entry,
    )  # fmt: skip


def materialize(plan: JobPlan, manifest: dict[str, Any] | None = None) -> Path:
    """Create the run dir and write the script, bind.sh and manifest; nothing left on failure."""
    run_dir = plan.run_dir
    create_run_dir(run_dir)
    try:
        write_atomic(plan.script_path, plan.script, mode=0o750)
        if plan.profile.scheduler == "slurm":
            plan.launch.write_bind_script()
        if plan.decision is not None:
            write_decision(run_dir, plan.decision)
        write_json(run_dir / runfiles.MANIFEST, manifest or plan.manifest())
    except BaseException:
        remove_run_dir(run_dir)
        raise
    return plan.script_path


def _print_decisions(plan: JobPlan) -> None:
    if plan.decision is not None:
        print(plan.decision.log_line())
    mem = plan.memory
    if mem.get("checked"):
        gib = 1024**3
        print(
            f"memory: {mem['predicted_peak_bytes'] / gib:.1f} of {mem['capacity_bytes'] / gib:.0f}"
            f" GiB per {mem['gpu']} at -b {mem['micro_batch']} (largest that fits: "
            f"{mem['largest_micro_batch']})"
        )


def render_main(argv: list[str]) -> int:
    """Write the job into a new run directory (checks that need no cluster); the script's path
    is the last line printed."""
    plan = plan_job(request(stage_parser("render").parse_args(argv)))
    script = materialize(plan)
    _print_decisions(plan)
    print(f"run directory: {script.parent}")
    print(script)
    return 0


def preflight_main(argv: list[str]) -> int:
    """Every check a submission makes, and nothing written or submitted."""
    plan = plan_job(request(stage_parser("preflight").parse_args(argv)))
    done = preflight.check(plan)
    _print_decisions(plan)
    for line in ["trainer flags parsed by the trainer's parser", *done]:
        print(f"ok: {line}")
    print(
        f"preflight passed: {plan.spec.model} {plan.spec.stage} on {plan.profile.name} "
        f"({plan.spec.partition}, {plan.spec.nodes} node(s) x {plan.spec.tasks_per_node} rank(s))"
    )
    return 0


def submit_main(argv: list[str]) -> int:
    """Plan, preflight, render, then sbatch it (slurm) or run it here (local)."""
    plan = plan_job(request(stage_parser("submit").parse_args(argv)))
    checks = preflight.check(plan)
    script = materialize(plan, plan.manifest(preflight=checks))
    if plan.profile.scheduler == "local":
        return _run_local(plan, script)
    job_id = sbatch_run(script)
    write_json(script.parent / runfiles.MANIFEST, plan.manifest([job_id], preflight=checks))
    _print_decisions(plan)
    print(f"submitted batch job {job_id}")
    print(f"run directory: {script.parent}")
    print(script)
    return 0


def _run_local(plan: JobPlan, script: Path) -> int:
    print(f"running {script} here (profile {plan.profile.name} has no scheduler)", flush=True)
    rc = subprocess.run(["bash", str(script)], check=False).returncode
    write_json(script.parent / runfiles.MANIFEST, plan.manifest(local_exit_status=rc))
    print(f"run directory: {script.parent}")
    print(script)
    return rc


def _load(command: str) -> Any:
    module, _, func = COMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        known = ", ".join(COMMANDS)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command {argv[0]!r}; commands: {known}", file=sys.stderr)
            return USAGE
        print(f"usage: python -m vitpod.workflows {{{known}}} [options]")
        return 0 if argv else USAGE
    try:
        return int(_load(argv[0])(argv[1:]) or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
