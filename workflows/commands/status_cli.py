"""`make status RUN=...`: the status table of a run, or a live view with FOLLOW=1."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from vitpod.registry import runfiles
from vitpod.trainer.exitcodes import USAGE
from vitpod.workflows.watching import follow
from vitpod.workflows.watching.status import as_dict, format_status, run_status
from vitpod.workflows.watching.triage import HANG_FACTOR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitpod.workflows status", description=__doc__)
    parser.add_argument("--run", required=True, help="pipeline directory or stage run directory")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--follow", action="store_true", help="live view until the run ends (make ... FOLLOW=1)"
    )
    parser.add_argument(
        "--interval", type=float, default=None, help="seconds between polls with --follow"
    )
    parser.add_argument(
        "--hang-factor", type=float, default=HANG_FACTOR,
        help="a running stage is stuck after this many median step times without a step",
    )  # fmt: skip
    args = parser.parse_args(argv)
    run = Path(args.run) if args.run else None
    markers = (runfiles.PIPELINE, runfiles.MANIFEST, runfiles.STUDY)
    if run is None or not any((run / name).is_file() for name in markers):
        print(
            f"error: RUN={args.run!r} is not a run directory (no {', '.join(markers)}); pass the "
            "directory printed by `make pipeline`/`make pretrain`/`make scaling`",
            file=sys.stderr,
        )
        return USAGE
    before_poll = _handover(run)
    if args.follow or (run / runfiles.STUDY).is_file():
        if not args.follow:  # a study's snapshot: one poll, plain lines
            target = follow.Target(run)
            target.poll()
            print("\n".join(follow.plain_lines(target)))
            return 0
        return follow.follow(run, interval=args.interval, hang_factor=args.hang_factor,
                             before_poll=before_poll)  # fmt: skip
    if before_poll is not None:
        before_poll()
    statuses = run_status(run, hang_factor=args.hang_factor)
    if args.json:
        print(json.dumps([as_dict(s) for s in statuses], indent=2))
    else:
        print(format_status(statuses))
    return 0


def _handover(run: Path) -> Callable[[], None] | None:
    """A pipeline across clusters (chain_cross.py): each look also hands the fine-tune over once
    the pretrain completed, as the process that submitted it would."""
    path = run / runfiles.PIPELINE
    if not path.is_file() or not runfiles.read_record(path).get("crossing"):
        return None
    from vitpod.workflows.pipeline.chain import (
        Chain,  # the chain's imports only for such a pipeline
    )
    from vitpod.workflows.pipeline.chain_watch import advance_cross

    chain = Chain.from_dir(run)
    return lambda: advance_cross(chain)
