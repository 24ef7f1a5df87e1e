"""`make pipeline`: submit the pretrain -> finetune chain; wait when asked (always locally)."""

from __future__ import annotations

import argparse
import json
import sys

from vitpod.registry import runfiles
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.rundir import write_json
from vitpod.workflows.pipeline.chain import Chain, ChainError
from vitpod.workflows.pipeline.chain_stage import decision_of, job_plan
from vitpod.workflows.planning import sbatchopts
from vitpod.workflows.planning.flags import request_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vitpod.workflows pipeline", description=__doc__,
        parents=[request_flags("cluster", "model", "nodes", "args", "timeout",
                               nodes="node count of every stage (a fine-tune partition with "
                               "fewer nodes keeps its own count)",
                               args="extra trainer flags for both stages")],
    )  # fmt: skip
    parser.add_argument("--finetune-from", default="", help="skip pretrain; finetune this run")
    parser.add_argument("--teacher", default="", help="make missing token labels with this teacher")
    parser.add_argument("--teacher-checkpoint", default="", help="weights of a timm-name teacher")
    parser.add_argument("--wait", action="store_true", help="wait for the end (Slurm profiles)")
    parser.add_argument(
        "--finetune-nodes", default="", help="the fine-tune's node count (FT_NODES)"
    )
    parser.add_argument(
        "--finetune-cluster", default="",
        help="the fine-tune's profile (FT_CLUSTER; default: --cluster's); another Slurm cluster "
        "or storage: this process submits it once the pretrain completed and its model was "
        "carried across, so it waits",
    )  # fmt: skip
    sbatchopts.add_flags(parser)
    sbatchopts.add_flags(parser, "finetune-")
    parser.add_argument(
        "--offline", action="store_true",
        help="write every stage's script into the pipeline directory, ask Slurm nothing, "
        "submit nothing (make OFFLINE=1)",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print every script it would submit (labeling arrays first); write and submit "
        "nothing (with --offline: Slurm not asked)",
    )  # fmt: skip
    parser.add_argument(
        "--place",
        action="store_true",
        help="choose the first stage's node count by predicted finish (PLACE=1)",
    )
    parser.add_argument("--deadline", default="", help="with --place: the fewest GPU-hours "
                        "finishing by then (DEADLINE=)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    chain = Chain(
        ns.cluster,
        ns.model,
        ns.nodes or None,
        ns.args,
        finetune_from=ns.finetune_from or None,
        teacher=ns.teacher,
        teacher_checkpoint=ns.teacher_checkpoint,
        time=ns.time,
        finetune_nodes=ns.finetune_nodes or None,
        finetune_time=ns.finetune_time,
        offline=ns.offline,
        slurm=sbatchopts.from_namespace(ns),
        finetune_slurm=sbatchopts.from_namespace(ns, "finetune-"),
        finetune_cluster=ns.finetune_cluster,
        place=ns.place,
        deadline=ns.deadline,
    )
    if ns.dry_run:
        return _dry_run(chain)
    if ns.offline:
        if ns.wait:
            raise ConfigError("--wait with --offline (OFFLINE=1): nothing is submitted; drop one")
        return _render(chain)
    run = chain.submit()
    assert run.directory is not None
    if ns.wait or not run.uses_slurm or run.crossing:
        try:
            report = run.wait(timeout=ns.timeout)
        except ChainError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        write_json(run.directory / runfiles.REPORT, report)
        print(json.dumps(report, indent=2))
        print(f"status: make status RUN={run.directory}")
        print(run.directory / runfiles.REPORT)
        return 0
    print(f"status: make status RUN={run.directory}")
    print(run.directory)
    return 0


def _render(chain: Chain) -> int:
    """OFFLINE=1: every stage's run directory written, its script's path printed."""
    written = chain.render()
    for name, script in written.items():
        rec = chain.stages.get(name)
        if rec is not None:
            spec = job_plan(rec).spec
            line = f"{name}: {spec.nodes} node(s) on partition {spec.partition}, time {spec.time}"
            decision = decision_of(rec)
            if decision is not None and decision.precision is not None:
                line += f"; {decision.precision.line()}"
            print(line)
        print(f"{name}: {script}")
    print(f"pipeline directory (offline: rendered, nothing submitted): {chain.directory}")
    return 0


def _dry_run(chain: Chain) -> int:
    """--dry-run: plan every stage (the whole preflight unless --offline), print the scripts."""
    records = chain.plan()
    scripts = [(f"labels-{stage}", job.plan.run_dir, job.script)
               for stage, job in chain.label_jobs.items()]  # fmt: skip
    scripts += [(name, rec.run_dir, job_plan(rec).script) for name, rec in records.items()]
    for name, run_dir, script in scripts:
        print(f"# ---- {name}: would write {run_dir} and submit this (dry run)")
        print(script, end="" if script.endswith("\n") else "\n")
    print(f"# dry run: pipeline directory {chain.directory} not written; nothing submitted")
    return 0
