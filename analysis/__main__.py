"""Command line: `python -m vitpod.analysis report STUDY_DIR` (or several run directories)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vitpod.analysis.scaling import MODES, STUDY_FILE, load_study, study_from_runs


def report_main(args: argparse.Namespace) -> int:
    from vitpod.analysis.report import write_report

    paths = [Path(p) for p in args.paths if p]
    if not paths:
        print("report: give a study directory (make report STUDY=studies/NAME)", file=sys.stderr)
        return 2
    missing = [str(p) for p in paths if not p.is_dir()]
    if missing:
        print(f"report: no such directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    if len(paths) == 1 and (paths[0] / STUDY_FILE).is_file():
        study = load_study(paths[0])
    else:
        study = study_from_runs(paths, args.mode)
    html = write_report(study, args.out)
    print(html)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vitpod.analysis", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="scaling table, plots and HTML report of a study")
    report.add_argument("paths", nargs="*", help="a study directory, or several run directories")
    report.add_argument("--mode", choices=MODES, default="strong", help="for loose run dirs")
    report.add_argument("--out", type=Path, default=None, help="output dir (default STUDY/report)")
    report.set_defaults(func=report_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
