"""The doctor's all-reduce: a short commbench job on the good nodes against the calibration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vitpod.analysis import calibrate as fitting
from vitpod.registry import runfiles
from vitpod.workflows.planning import preflight
from vitpod.workflows.planning.spec import COMMBENCH_OUT
from vitpod.workflows.site.profile import profile_path
from vitpod.workflows.studies import calibrate
from vitpod.workflows.submit.submission import submit_plan

SLOW_FACTOR = 3.0
"""Measured over calibrated time of the largest message: above it the fabric is flagged (a
shared or degraded link; the calibration's own fit error is well under this)."""
SIZES = "256K 1M"
ITERS = 5
WAIT_S = 300.0


def predicted_s(cal: fitting.Calibration, level: str, nbytes: float) -> float | None:
    """The calibrated all-reduce time of `nbytes` at `level` (None: the fit has no such level)."""
    fit = cal.levels.get(level)
    if fit is None:
        return None
    steps, per_rank = fitting.ring_regressors(fit.ranks, nbytes)
    return cal.call_overhead + steps * fit.latency_s + per_rank / fit.bw


def measured_s(bench: dict, level: str) -> tuple[float, float] | None:
    """(bytes, median seconds) of the largest message at `level` in a commbench file."""
    times = bench.get("levels", {}).get(level, {}).get("median_s", {}).get("all_reduce")
    if not times:
        return None
    return float(bench["sizes"][-1]), float(times[-1])


def verdict(cal: fitting.Calibration, bench: dict, factor: float = SLOW_FACTOR) -> tuple[bool, str]:
    """(slow?, one line) for the world all-reduce against the calibration."""
    got = measured_s(bench, "world")
    want = predicted_s(cal, "world", got[0]) if got else None
    if got is None or want is None:
        return False, "skipped: the calibration or the benchmark has no world level"
    ratio = got[1] / want
    line = (f"{got[0] / 2**20:g} MiB over {bench.get('world_size')} ranks took "
            f"{got[1] * 1e3:.2f} ms, calibrated {want * 1e3:.2f} ms ({cal.label}): "
            f"{ratio:.1f}x")  # fmt: skip
    return ratio > factor, line + (f" > {factor:g}x" if ratio > factor else "")


def check(ns: argparse.Namespace, exclude: list[str], nodes: int) -> tuple[bool, str]:
    """Run the benchmark over `nodes` good nodes and compare; (slow?, line)."""
    path = fitting.calibration_path(profile_path(ns.cluster))
    if not path.is_file():
        return False, f"skipped: no calibration for this profile ({path.name})"
    cal = fitting.load(path)
    bench_ns = argparse.Namespace(  # the doctor's flags (its sbatch options too), then the bench's
        **{**vars(ns), "nodes": str(nodes), "sizes": SIZES, "iters": str(ITERS),
           "args": "--levels world", "out": "", "timeout": WAIT_S,
           "exclude": ",".join(filter(None, [ns.exclude, *exclude]))},
    )  # fmt: skip
    plan, _ = calibrate.prepare(bench_ns)
    checks = preflight.check(plan)
    job = submit_plan(plan, checks)
    script = job.script
    calibrate.wait(job.job_id, script.parent, WAIT_S)
    bench_file = Path(script.parent) / COMMBENCH_OUT
    if not bench_file.is_file():
        return True, f"the benchmark wrote no {COMMBENCH_OUT}; see {script.parent / runfiles.LOGS}"
    return verdict(cal, json.loads(bench_file.read_text()))
