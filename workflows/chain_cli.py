"""`make pipeline`: submit the pretrain -> finetune chain; wait when asked (always locally)."""

from __future__ import annotations

import argparse
import json
import sys

from vitpod.registry import runfiles
from vitpod.workflows.chain import Chain, ChainError
from vitpod.workflows.flags import request_flags
from vitpod.workflows.rundir import write_json


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m vitpod.workflows pipeline", description=__doc__,
        parents=[request_flags("cluster", "model", "nodes", "args", "timeout",
                               args="extra trainer flags for both stages")],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.add_argument("--finetune-from", default="", help="skip pretrain; finetune this run")
    parser.add_argument("--teacher", default="", help="make missing token labels with this teacher")
    parser.add_argument("--teacher-checkpoint", default="", help="weights of a timm-name teacher")
    parser.add_argument("--wait", action="store_true", help="wait for the end (Slurm profiles)")
    ns = parser.parse_args(argv)
    run = Chain(
        ns.cluster,
        ns.model,
        ns.nodes or None,
        ns.args,
        finetune_from=ns.finetune_from or None,
        teacher=ns.teacher,
        teacher_checkpoint=ns.teacher_checkpoint,
    ).submit()
    assert run.directory is not None
    if ns.wait or not run.uses_slurm:
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
