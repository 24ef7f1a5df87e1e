"""`vitpod <cmd>`: a lazy dispatch table; render, preflight, submit: one planner."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.io import private_umask
from vitpod.trainer.exitcodes import USAGE
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning import placement, preflight, sbatchopts
from vitpod.workflows.planning.flags import request_flags
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.submit import rendered
from vitpod.workflows.submit.submission import materialize, submit_plan

# Each command's `main(argv) -> int`, imported only when used, so one area's missing module
# breaks only its own command.
COMMANDS = {
    "render": "vitpod.workflows.cli:render_main",
    "place": "vitpod.workflows.cli:place_main",
    "preflight": "vitpod.workflows.cli:preflight_main",
    "submit": "vitpod.workflows.cli:submit_main",
    "pipeline": "vitpod.workflows.commands.chain_cli:main",
    "demo": "vitpod.workflows.pipeline.demo:main",
    "status": "vitpod.workflows.commands.status_cli:main",
    "scaling": "vitpod.workflows.studies.scaling:main",
    "calibrate": "vitpod.workflows.studies.calibrate:main",
    "token-labels": "vitpod.workflows.pipeline.labels:main",
    "memory": "vitpod.workflows.planning.planners:memory_cli",
    "layouts": "vitpod.workflows.planning.planners:layouts_cli",
    "profile": "vitpod.workflows.commands.profile_cli:main",
    "doctor": "vitpod.workflows.commands.doctor_cli:main",
    "resume": "vitpod.workflows.submit.resume:main",
    "list": "vitpod.workflows.commands.jobctl_cli:list_main",
    "cancel": "vitpod.workflows.commands.jobctl_cli:cancel_main",
    "clean": "vitpod.workflows.commands.jobctl_cli:clean_main",
    "completion": "vitpod.workflows.cli:completion_main",
}
# One line per command for `vitpod --help` (kept here: the dispatch imports nothing to show it).
DESCRIPTIONS = {
    "render": "write one stage's job into a new run directory (no preflight)",
    "place": "render the candidate (node count) Slurm and the step-time model say finishes first",
    "preflight": "every check a submission makes; nothing written or submitted",
    "submit": "plan, preflight, render and sbatch one stage (--dry-run: print it only); "
    "RUN_DIR: submit a rendered run or pipeline as reviewed",
    "pipeline": "the pretrain -> fine-tune chain, token labels first with --teacher",
    "demo": "the whole 224->512 style chain on this machine",
    "status": "state, progress and root cause of a run, pipeline or study (--follow)",
    "scaling": "a scaling study: one job per point plus a report job",
    "calibrate": "time collectives, fit the fabric the cost model uses",
    "token-labels": "make VOLO token labels with a teacher (a job array)",
    "memory": "predicted peak GPU memory of a model and batch",
    "layouts": "data/tensor/pipeline layouts a model fits, priced",
    "profile": "discover a cluster into a new profile, or --check one",
    "doctor": "check a partition's nodes (GPUs, InfiniBand, disk, image)",
    "resume": "continue a stopped run, also on another node count",
    "list": "runs, pipelines and studies under the run root, with state and progress",
    "cancel": "cancel every job of a run, pipeline or study; the directory stays",
    "clean": "delete old or ended runs (--older-than, --state); prints the plan, --yes deletes",
    "completion": "print a bash completion script for vitpod (source it, or save it)",
}


def stage_parser(prog: str) -> argparse.ArgumentParser:
    """Arguments of render/preflight/submit; an empty string (from make) means 'not given'."""
    p = argparse.ArgumentParser(
        prog=f"vitpod {prog}",
        parents=[request_flags("stage", "cluster", "model", "nodes", "args", "run-root",
                               nodes="override the stage partition's node count",
                               args="extra trainer flags, shell-quoted")],
    )  # fmt: skip
    if prog == "submit":
        p.add_argument(
            "rendered", nargs="?", default="", metavar="RUN_DIR",
            help="a run or pipeline directory written by make render / make pipeline OFFLINE=1: "
            "preflight it against the live cluster and submit its files as they are",
        )  # fmt: skip
    p.add_argument("--finetune-from", default="", help="run dir or checkpoint to fine-tune")
    p.add_argument("--dependency", default="", help="sbatch dependency, e.g. afterok:123")
    p.add_argument(
        "--entry",
        default="trainer",
        choices=("trainer", "rankinfo"),
        help="what each rank runs (rankinfo: print rank facts, for cluster checks)",
    )
    p.add_argument(
        "--offline", action="store_true",
        help="render/preflight (submit --dry-run): skip the checks that ask Slurm (make OFFLINE=1)",
    )  # fmt: skip
    sbatchopts.add_flags(p)
    if prog == "submit":
        p.add_argument(
            "--dry-run", action="store_true",
            help="print the script it would submit; write and submit nothing",
        )  # fmt: skip
        p.add_argument(
            "--place",
            action="store_true",
            help="choose the node count by predicted finish first (make PLACE=1)",
        )
    if prog in ("submit", "place"):
        p.add_argument("--deadline", default="", help=f"placement: {placement.DEADLINE_FORMAT}; "
                       "the fewest GPU-hours finishing by then (make DEADLINE=)")  # fmt: skip
    return p


def request(ns: argparse.Namespace) -> Request:
    return Request(
        cluster=ns.cluster, model=ns.model, stage=ns.stage, nodes=ns.nodes, time=ns.time,
        args=ns.args,
        finetune_from=ns.finetune_from, dependency=ns.dependency, run_root=ns.run_root,
        entry=ns.entry, offline=ns.offline, slurm=sbatchopts.from_namespace(ns),
    )  # fmt: skip


def _print_decisions(plan: JobPlan) -> None:
    if plan.decision is not None:
        print(plan.decision.log_line())
        if plan.decision.precision is not None:
            print(plan.decision.precision.line())
        if plan.decision.checkpoint is not None:
            print(plan.decision.checkpoint.line())
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


def place_main(argv: list[str]) -> int:
    """Predict every candidate, print the table, write the chosen one into a new run directory
    (nothing submitted); the script's path is the last line printed."""
    ns = stage_parser("place").parse_args(argv)
    plan = _place(ns)
    script = materialize(plan)
    _print_decisions(plan)
    print(f"run directory: {script.parent}")
    print(script)
    return 0


def _planned(ns: argparse.Namespace) -> JobPlan:
    """submit's plan: placed with --place, else as asked; DEADLINE without --place is refused."""
    if ns.place:
        return _place(ns)
    if ns.deadline.strip():
        raise ConfigError(f"DEADLINE={ns.deadline!r} chooses among placement candidates; add "
                          "PLACE=1 (--place) or use make place, or drop DEADLINE")  # fmt: skip
    return plan_job(request(ns))


def _place(ns: argparse.Namespace) -> JobPlan:
    plan = placement.place(request(ns), ns.deadline)
    assert plan.decision is not None and plan.decision.placement is not None
    placement.print_placement(plan.decision.placement)
    return plan


def preflight_main(argv: list[str]) -> int:
    """Every check a submission makes, and nothing written or submitted."""
    ns = stage_parser("preflight").parse_args(argv)
    plan = plan_job(request(ns))
    done = preflight.check(plan, offline=ns.offline)
    _print_decisions(plan)
    for line in ["trainer flags parsed by the trainer's parser", *done]:
        print(f"ok: {line}")
    offline = " (offline: Slurm not asked)" if ns.offline else ""
    print(
        f"preflight passed{offline}: {plan.spec.model} {plan.spec.stage} on {plan.profile.name} "
        f"({plan.spec.partition}, {plan.spec.nodes} node(s) x {plan.spec.tasks_per_node} rank(s))"
    )
    return 0


def submit_main(argv: list[str]) -> int:
    """Plan, preflight, render, then sbatch it (slurm) or run it here (local); with RUN_DIR,
    the rendered run or pipeline there (workflows/submit/rendered.py)."""
    ns = stage_parser("submit").parse_args(argv)
    if ns.rendered:
        return _submit_rendered(ns.rendered, ns.dry_run)
    if ns.dry_run:
        return _dry_run(ns)
    if ns.offline:
        raise ConfigError("--offline (OFFLINE=1) is for render/preflight only: a submission "
                          "needs Slurm's answer; drop OFFLINE=1")  # fmt: skip
    plan = _planned(ns)
    checks = preflight.check(plan)
    if plan.profile.scheduler == "local":
        return _run_local(plan, materialize(plan, plan.manifest(preflight=checks)))
    job = submit_plan(plan, checks)
    _print_decisions(plan)
    print(f"submitted batch job {job.job_id}")
    print(f"run directory: {job.script.parent}")
    print(job.script)
    return 0


def _submit_rendered(path: str, dry_run: bool) -> int:
    """RUN_DIR: a pipeline directory (pipeline.json) through its Chain, else one run."""
    if (Path(path).expanduser() / runfiles.STUDY).is_file():
        raise ConfigError(
            f"{path} is a scaling study: submit it with make scaling (no OFFLINE=1); "
            "vitpod submit takes a run or pipeline directory"
        )
    if (Path(path).expanduser() / runfiles.PIPELINE).is_file():
        from vitpod.workflows.pipeline.chain import Chain

        if dry_run:
            raise ConfigError("--dry-run with a pipeline directory: its scripts are the files "
                              "there; drop --dry-run to submit them")  # fmt: skip
        chain = Chain.from_dir(path)
        if ids := [j for rec in chain.stages.values() for j in rec.job_ids] + chain.label_job_ids:
            raise ConfigError(f"{path} was already submitted (job {' '.join(ids)}); watch it: "
                              f"make status RUN={path}")  # fmt: skip
        chain.submit()
        print(f"status: make status RUN={chain.directory}")
        print(chain.directory)
        return 0
    return rendered.submit_run(path, dry_run)


def _dry_run(ns: argparse.Namespace) -> int:
    """submit --dry-run: the plan and its preflight (none of Slurm's checks with --offline);
    prints the script, writes nothing."""
    plan = _planned(ns)
    checks = [] if ns.offline else preflight.check(plan)
    _print_decisions(plan)
    for line in checks:
        print(f"ok: {line}")
    print(f"# dry run: would write {plan.script_path} and submit it; nothing written or submitted")
    print(plan.script, end="" if plan.script.endswith("\n") else "\n")
    return 0


def _run_local(plan: JobPlan, script: Path) -> int:
    rc = rendered.run_here(script, plan.profile.name)
    print(f"run directory: {script.parent}")
    print(script)
    return rc


def _load(command: str) -> Any:
    module, _, func = COMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), func)


def version() -> str:
    """The installed package's version, else pyproject.toml's (a source checkout)."""
    try:
        return importlib.metadata.version("vitpod")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        return found[1] if found else "unknown"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:{width}s}  {DESCRIPTIONS.get(name, '')}" for name in COMMANDS]
    return "\n".join([
        "usage: vitpod <command> [options]    (the same: python -m vitpod.workflows <command>)",
        "", "commands:", *lines, "",
        "vitpod <command> --help lists a command's options; vitpod --version prints the version",
    ])  # fmt: skip


def completion_main(argv: list[str]) -> int:
    from vitpod.workflows import completion  # it reads this table; it does not import it

    return completion.main(argv, COMMANDS, _load)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"vitpod {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} "
              "(vitpod --help)", file=sys.stderr)  # fmt: skip
        return USAGE
    umask = private_umask()  # run files 0640, dirs 0750; sbatch hands this umask to the job
    try:
        return int(_load(argv[0])(argv[1:]) or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    finally:
        os.umask(umask)  # a caller in this process (a test) keeps its own
