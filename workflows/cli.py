"""`python -m workflows <cmd>`: a lazy dispatch table; render and submit share one code path."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.exitcodes import USAGE
from workflows.errors import ConfigError
from workflows.profile import load_profile, profile_path
from workflows.recipe import load_recipe
from workflows.rundir import (
    RUN_ROOT_ENV,
    check_path_safe,
    create_run_dir,
    git_info,
    image_info,
    new_run_path,
    remove_run_dir,
    runs_root,
    write_atomic,
    write_json,
)
from workflows.spec import JobSpec, LaunchPlan, build_spec, launch_plan
from workflows.submission import check_can_submit, sbatch
from workflows.templating import render

DEFAULT_MODEL = "volo_d1"  # when neither MODEL nor the profile's default_model is given

# Each command's `main(argv) -> int`, imported only when used, so one area's missing module
# breaks only its own command.
COMMANDS = {
    "render": "workflows.cli:render_main",
    "submit": "workflows.cli:submit_main",
    "pipeline": "workflows.pipeline:main",
    "demo": "workflows.demo:main",
    "status": "workflows.status:main",
    "scaling": "workflows.scaling:main",
    "calibrate": "workflows.calibrate:main",
}


@dataclass(frozen=True)
class Prepared:
    """A validated job, rendered in memory; nothing on disk yet."""

    spec: JobSpec
    plan: LaunchPlan
    script_name: str
    script: str
    manifest: dict[str, Any]


def stage_parser(prog: str) -> argparse.ArgumentParser:
    """Arguments of render/submit; an empty string (from make) means 'not given'."""
    p = argparse.ArgumentParser(prog=f"python -m workflows {prog}")
    p.add_argument("--stage", default="pretrain", choices=("pretrain", "finetune"))
    p.add_argument("--cluster", default="local", help="bundled profile name or a YAML path")
    p.add_argument(
        "--model",
        default="",
        help="recipe name or YAML path (default: the profile's default_model)",
    )
    p.add_argument("--nodes", default="", help="override the profile's node count")
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


def prepare(ns: argparse.Namespace, run_dir: Path | None = None) -> Prepared:
    """Validate everything and render the job in memory; raises ConfigError on bad input."""
    profile = load_profile(ns.cluster)
    recipe = load_recipe(ns.model or profile.default_model or DEFAULT_MODEL)
    run_dir = run_dir or new_run_path(runs_root(profile, ns.run_root), recipe.model, ns.stage)
    check_path_safe(run_dir, "run root", "choose another storage.runs / --run-root")
    spec = build_spec(
        profile,
        recipe,
        ns.stage,
        run_dir=run_dir,
        nodes=ns.nodes,
        args=ns.args,
        finetune_from=ns.finetune_from or None,
        dependency=ns.dependency or None,
        entry=ns.entry,
    )
    plan = launch_plan(spec)
    template, script_name = (
        ("sbatch.sh.j2", "job.sbatch")
        if profile.scheduler == "slurm"
        else ("local.sh.j2", "job.sh")
    )
    script = render(template, {"spec": spec, "plan": plan})
    manifest = _manifest(ns, spec, plan, recipe.stage(ns.stage).model_dump(), script_name)
    return Prepared(spec, plan, script_name, script, manifest)


def _manifest(
    ns: argparse.Namespace, spec: JobSpec, plan: LaunchPlan, stage: dict[str, Any], script: str
) -> dict[str, Any]:
    return {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "script": script,
        "profile": {
            "name": spec.profile.name,
            "path": str(profile_path(ns.cluster).resolve()),
            "values": spec.profile.model_dump(),
        },
        "recipe": {"model": spec.model, "stage": spec.stage, "values": stage},
        "overrides": {"nodes": ns.nodes, "args": ns.args, "finetune_from": ns.finetune_from},
        "resolved": {
            "run_dir": spec.run_dir,
            "partition": spec.partition,
            "time": spec.time,
            "nodes": spec.nodes,
            "tasks_per_node": spec.tasks_per_node,
            "world_size": spec.world_size,
            "dependency": spec.dependency,
            "command": list(spec.command),
            "srun_args": list(plan.srun_args),
            "env": plan.env,
        },
        "git": git_info(),
        "image": image_info(spec.profile),
        "job_ids": [],
    }


def materialize(job: Prepared) -> Path:
    """Create the run dir and write the script, bind.sh and manifest; nothing left on failure."""
    run_dir = Path(job.spec.run_dir)
    create_run_dir(run_dir)
    try:
        script = run_dir / job.script_name
        write_atomic(script, job.script, mode=0o750)
        if job.spec.profile.scheduler == "slurm":
            job.plan.write_bind_script()
        write_json(run_dir / "manifest.json", job.manifest)
    except BaseException:
        remove_run_dir(run_dir)
        raise
    return script


def render_main(argv: list[str]) -> int:
    """Write the job into a new run directory; the script's path is the last line printed."""
    ns = stage_parser("render").parse_args(argv)
    script = materialize(prepare(ns))
    print(f"run directory: {script.parent}")
    print(script)
    return 0


def submit_main(argv: list[str]) -> int:
    """Render, then sbatch it (slurm) or run it here (local); job ids go into the manifest."""
    ns = stage_parser("submit").parse_args(argv)
    job = prepare(ns)
    check_can_submit(job.spec)
    script = materialize(job)
    if job.spec.profile.scheduler == "local":
        return _run_local(job, script)
    try:
        job_id = sbatch(script)
    except ConfigError:
        remove_run_dir(script.parent)
        raise
    manifest = {**job.manifest, "job_ids": [job_id]}
    write_json(script.parent / "manifest.json", manifest)
    print(f"submitted batch job {job_id}")
    print(f"run directory: {script.parent}")
    print(script)
    return 0


def _run_local(job: Prepared, script: Path) -> int:
    print(f"running {script} here (profile {job.spec.profile.name} has no scheduler)", flush=True)
    rc = subprocess.run(["bash", str(script)], check=False).returncode
    write_json(script.parent / "manifest.json", {**job.manifest, "local_exit_status": rc})
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
        print(f"usage: python -m workflows {{{known}}} [options]")
        return 0 if argv else USAGE
    try:
        return int(_load(argv[0])(argv[1:]) or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
