"""Fit the cost model's latency and bandwidth to a measured collective sweep (pure arithmetic).

`vitpod.trainer.engines.commbench` times all-reduce, reduce and broadcast over message sizes at four
levels (one rank, the ranks of one node, one rank per node, the whole job). Each all-reduce level is
fitted with the formula analysis/commcost.py prices it with, the ring of Thakur, Rabenseifner &
Gropp (2005, "Optimization of collective communication operations in MPICH"), in Hockney's
alpha-beta form plus LogP's per-call overhead `o`:

    T(M) = o + 2(n-1) alpha + 2(n-1)/n * M / B

so the fitted alpha and B are the Fabric's latency and (bus) bandwidth, the same quantity
nccl-tests report as "busbw" (NCCL tests PERFORMANCE.md: busbw = algbw x 2(n-1)/n). Levels:

- ``self`` (1 rank) -> ``call_overhead`` (median time of a call that moves nothing);
- ``intra`` (the ranks of one node) -> ``intra_latency``, ``intra_bw``;
- ``world`` spanning nodes -> ``inter_latency`` and the node's bandwidth across nodes: the
  flat ring crosses node boundaries, so its slowest hop sets its pace, as commcost.ring_s
  assumes. ``inter`` (one rank per node, one rail) gives ``nic_bw`` directly when the world
  ring is not bounded by the network, and is kept as a check.

Reduce and broadcast are fitted as plain lines (intercept, seconds per byte) and stored; the
parameter-server hook is one reduce and one broadcast per bucket. Least squares are weighted by
1/T (relative error), so small messages, which pin the latency, count as much as large ones.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.analysis.fabric import Fabric
from vitpod.registry import io

FORMAT = "vitpod-calibration/1"
BENCH_FORMAT = "vitpod-commbench/1"
SUFFIX = ".calibration.json"


class CalibrationError(ValueError):
    """A benchmark file or a stored fit that cannot be used; the message names the fix."""


@dataclass(frozen=True, slots=True)
class LevelFit:
    """One level's all-reduce fit, in the cost model's units."""

    ranks: int
    nodes: int
    latency_s: float
    """alpha: seconds per ring step (hop)."""
    bw: float
    """B: bus bandwidth, bytes/s."""
    max_rel_error: float
    """Largest |fit - measured| / measured over the sizes."""


@dataclass(frozen=True, slots=True)
class Line:
    """T(M) = intercept + M * per_byte (reduce, broadcast)."""

    intercept_s: float
    per_byte_s: float

    def __call__(self, nbytes: float) -> float:
        return self.intercept_s + nbytes * self.per_byte_s


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A fit, where it came from, and the raw points it was fitted to."""

    cluster: str
    job_id: str | None
    date: str
    """UTC ISO time of the fit."""
    backend: str
    world_size: int
    nodes: int
    ranks_per_node: int
    call_overhead: float
    levels: dict[str, LevelFit]
    lines: dict[str, dict[str, Line]] = field(default_factory=dict)
    """op -> level -> line, for reduce and broadcast."""
    fabric: dict[str, float] = field(default_factory=dict)
    """The Fabric fields this fit sets (what `apply` replaces)."""
    partition: str = ""
    """The Slurm partition measured (its node type's fabric is the one the fit replaces)."""
    bench: dict[str, Any] = field(default_factory=dict)
    """The benchmark's JSON as measured (sizes, medians, hosts)."""

    @property
    def label(self) -> str:
        """'calibration of DATE, job ID': what a decision says it used."""
        return f"calibration of {self.date}, job {self.job_id or 'unknown'}"

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["format"] = FORMAT
        return data


def ring_regressors(n: int, nbytes: float) -> tuple[float, float]:
    """(steps, bytes per rank) of a ring all-reduce: T - o = steps*alpha + bytes/B."""
    return 2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes


def weighted_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) minimising sum(((a + b x - y) / y)^2): relative-error least squares."""
    if len(xs) != len(ys) or len(xs) < 2 or len(set(xs)) < 2:
        raise CalibrationError("a fit needs at least two different message sizes; add --sizes")
    if min(ys) <= 0:
        raise CalibrationError(f"measured times must be > 0 s, got {min(ys)!r}")
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    sy = sum(wi * y for wi, y in zip(w, ys, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    return (sy - slope * sx) / sw, slope


def fit_ring(n: int, sizes: Sequence[float], times: Sequence[float], overhead: float) -> LevelFit:
    """alpha and B of a ring all-reduce among n ranks from (size, median seconds) points."""
    if n < 2:
        raise CalibrationError(f"a ring needs at least 2 ranks to fit, this level has {n}")
    steps, _ = ring_regressors(n, 1.0)
    xs = [ring_regressors(n, m)[1] for m in sizes]
    intercept, slope = weighted_line(xs, [t - overhead for t in times])
    if slope <= 0:
        raise CalibrationError(
            f"all-reduce among {n} ranks did not get slower with size (slope {slope:.3g} s/B); "
            "the machine was too noisy or the sizes too small: rerun with larger --sizes "
            "(e.g. up to 64M) or more --iters"
        )
    latency = max(0.0, intercept / steps)  # noise may put a tiny latency below zero
    bw = 1.0 / slope
    errors = [
        abs(overhead + steps * latency + x / bw - t) / t for x, t in zip(xs, times, strict=True)
    ]
    return LevelFit(ranks=n, nodes=0, latency_s=latency, bw=bw, max_rel_error=max(errors))


def _level(bench: Mapping[str, Any], name: str, op: str) -> tuple[int, int, list[float]] | None:
    level = bench.get("levels", {}).get(name)
    if not level or op not in level.get("median_s", {}):
        return None
    return int(level["ranks"]), int(level["nodes"]), [float(t) for t in level["median_s"][op]]


def check_bench(bench: Mapping[str, Any]) -> None:
    """The benchmark file's own format, or a CalibrationError naming the field."""
    if bench.get("format") != BENCH_FORMAT:
        raise CalibrationError(
            f"benchmark format is {bench.get('format')!r}, expected {BENCH_FORMAT!r}: write it "
            "with `python -m vitpod.trainer.engines.commbench` (make calibrate)"
        )
    for key in ("sizes", "levels", "world_size", "nodes", "backend"):
        if key not in bench:
            raise CalibrationError(f"benchmark file lacks {key!r}; rerun make calibrate")


def fit(
    bench: Mapping[str, Any],
    *,
    cluster: str = "",
    nics_per_node: int = 1,
    date: str | None = None,
    partition: str = "",
) -> Calibration:
    """A Calibration from `vitpod.trainer.engines.commbench`'s JSON (the module docstring has the
    map)."""
    check_bench(bench)
    sizes = [float(s) for s in bench["sizes"]]
    own = _level(bench, "self", "all_reduce")
    # A call that moves nothing: its median over sizes is the per-call overhead.
    overhead = statistics.median(own[2]) if own else 0.0
    levels: dict[str, LevelFit] = {}
    fabric: dict[str, float] = {"call_overhead": overhead}
    for name in ("intra", "inter", "world"):
        found = _level(bench, name, "all_reduce")
        if found is None or found[0] < 2:
            continue
        ranks, nodes, times = found
        levels[name] = dataclasses.replace(fit_ring(ranks, sizes, times, overhead), nodes=nodes)
    if "intra" in levels:
        fabric["intra_latency"] = levels["intra"].latency_s
        fabric["intra_bw"] = levels["intra"].bw
    world = levels.get("world")
    inter = levels.get("inter")
    if world is not None and world.nodes > 1:
        fabric["inter_latency"] = world.latency_s
        bounded_by_network = "intra_bw" not in fabric or world.bw < fabric["intra_bw"]
        if bounded_by_network or inter is None:
            fabric["nic_bw"] = world.bw / nics_per_node
        else:
            fabric["nic_bw"] = inter.bw
    elif inter is not None:
        fabric["inter_latency"] = inter.latency_s
        fabric["nic_bw"] = inter.bw
    if len(fabric) == 1:
        raise CalibrationError(
            "the benchmark has no level with 2 or more ranks: calibrate on at least 2 ranks "
            "(NODES=2, or a profile with 2 ranks per node)"
        )
    lines: dict[str, dict[str, Line]] = {}
    for op in ("reduce", "broadcast"):
        for name in ("intra", "inter", "world"):
            found = _level(bench, name, op)
            if found and found[0] >= 2:
                a, b = weighted_line(sizes, found[2])
                lines.setdefault(op, {})[name] = Line(a, b)
    return Calibration(
        cluster=cluster,
        job_id=bench.get("job_id"),
        date=date or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        backend=str(bench["backend"]),
        world_size=int(bench["world_size"]),
        nodes=int(bench["nodes"]),
        ranks_per_node=int(bench.get("ranks_per_node", 0)),
        call_overhead=overhead,
        levels=levels,
        lines=lines,
        fabric=fabric,
        bench=dict(bench),
        partition=partition,
    )


def apply(fabric: Fabric, calibration: Calibration) -> Fabric:
    """The profile's Fabric with the fitted fields replaced (the others, e.g. parameter-server
    machines, stay as the profile says)."""
    changes: dict[str, Any] = dict(calibration.fabric)
    return dataclasses.replace(fabric, **changes)


def calibration_path(profile_path: str | os.PathLike[str]) -> Path:
    """Where a profile's fit lives: beside it, `<profile stem>.calibration.json`."""
    path = Path(profile_path)
    return path.with_name(path.stem + SUFFIX)


def save(calibration: Calibration, path: str | os.PathLike[str]) -> Path:
    """Write the fit atomically (temp file, then rename); returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    io.write_text_atomic(target, json.dumps(calibration.as_dict(), indent=1, sort_keys=True) + "\n")
    return target


def from_dict(data: Mapping[str, Any], where: str = "calibration") -> Calibration:
    """A Calibration from its stored JSON, or a CalibrationError naming the field."""
    if data.get("format") != FORMAT:
        raise CalibrationError(
            f"{where}: format {data.get('format')!r} is not {FORMAT!r}; rerun make calibrate"
        )
    try:
        levels = {k: LevelFit(**v) for k, v in data["levels"].items()}
        lines = {
            op: {lvl: Line(**v) for lvl, v in per.items()}
            for op, per in data.get("lines", {}).items()
        }
        fabric = {k: float(v) for k, v in data["fabric"].items()}
        known = {f.name for f in dataclasses.fields(Fabric)}
        unknown = sorted(set(fabric) - known)
        if unknown:
            raise CalibrationError(f"{where}: fabric has unknown field(s) {unknown}")
        if any(not math.isfinite(v) or v < 0 for v in fabric.values()):
            raise CalibrationError(f"{where}: fabric values must be finite and >= 0: {fabric}")
        return Calibration(
            cluster=str(data["cluster"]),
            job_id=data.get("job_id"),
            date=str(data["date"]),
            backend=str(data["backend"]),
            world_size=int(data["world_size"]),
            nodes=int(data["nodes"]),
            ranks_per_node=int(data["ranks_per_node"]),
            call_overhead=float(data["call_overhead"]),
            levels=levels,
            lines=lines,
            fabric=fabric,
            bench=dict(data.get("bench", {})),
            partition=str(data.get("partition", "")),
        )
    except (KeyError, TypeError) as exc:
        raise CalibrationError(
            f"{where}: missing or bad field {exc}; rerun make calibrate"
        ) from None


def load(path: str | os.PathLike[str]) -> Calibration:
    """Read a stored fit (CalibrationError when it is not one)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"calibration file {p}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"calibration file {p}: expected a JSON object")
    return from_dict(data, str(p))


def load_for_profile(
    profile_path: str | os.PathLike[str], partition: str | None = None
) -> Calibration | None:
    """The fit stored beside a profile, or None when there is none or when it measured another
    partition than `partition` (another node type: its numbers would not apply)."""
    path = calibration_path(profile_path)
    if not path.is_file():
        return None
    cal = load(path)
    return cal if partition is None or cal.partition in ("", partition) else None


def summary(calibration: Calibration) -> list[str]:
    """Human lines: each level's latency and bandwidth, and what the fit sets."""
    out = [
        f"{calibration.cluster}: {calibration.label}, {calibration.backend}, "
        f"{calibration.world_size} ranks on {calibration.nodes} node(s)"
        + (f" of partition {calibration.partition}" if calibration.partition else ""),
        f"  call overhead {calibration.call_overhead * 1e6:.1f} us",
    ]
    for name, lv in calibration.levels.items():
        out.append(
            f"  {name:5s} ({lv.ranks} ranks, {lv.nodes} node(s)): latency "
            f"{lv.latency_s * 1e6:.1f} us/step, bus bandwidth {lv.bw / 1e9:.3g} GB/s, "
            f"worst point {100 * lv.max_rel_error:.0f}% off the fit"
        )
    fields_ = ", ".join(f"{k}={_fmt(k, v)}" for k, v in sorted(calibration.fabric.items()))
    out.append(f"  fabric: {fields_}")
    return out


def _fmt(name: str, value: float) -> str:
    if name.endswith("_bw"):
        return f"{value / 1e9:.4g} GB/s"
    return f"{value * 1e6:.4g} us"
