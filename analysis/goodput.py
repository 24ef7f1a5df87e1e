"""The goodput ledger: a run's wall time split into queue, start-up, training, stalls and loss."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles

PARTS = ("queue", "container", "startup", "training", "checkpoint", "eval", "lost", "shutdown")
# sacct's Submit/Start/End are whole seconds, cut down: a job that ended 0.4 s after the
# trainer's last record can read as ending 0.6 s before it.
SLURM_RESOLUTION_S = 1.0


@dataclass(frozen=True)
class Attempt:
    """One start of a job as Slurm accounted it (sacct -D: each requeue is its own line; a
    requeued attempt's Submit is the previous attempt's End)."""

    job_id: str
    restart: int
    submit: float
    start: float | None
    end: float | None
    devices: int = 0  # GPUs allocated (sacct AllocTRES gres/gpu), else CPUs; 0: unknown
    device_kind: str = ""  # "GPU" or "CPU"


@dataclass
class Ledger:
    """Seconds per part; `other` is the wall time no part explains (between-step overhead)."""

    wall: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    attempts: int = 0
    ranks: list[int] = field(default_factory=list)  # the world size of each start that stepped
    notes: list[str] = field(default_factory=list)
    # Device-hours: allocated = each attempt's devices x its run time (start to end, as Slurm
    # accounted it); useful = its devices x the training time of the steps the run kept.
    device_hours: float = 0.0
    useful_device_hours: float = 0.0
    device_kind: str = ""  # "GPU", "CPU" (CPU profiles), "" when accounting gave none
    start: float | None = None  # the first start Slurm accounted (Unix time); None: not yet
    end: float | None = None  # the last attempt's end; None while it runs or never started

    @property
    def other(self) -> float:
        return self.wall - sum(self.parts.values())

    def add(self, other: Ledger) -> None:
        still_open = any(led.attempts and led.end is None for led in (self, other))
        self.wall += other.wall
        self.attempts += other.attempts
        self.ranks += other.ranks
        for name, seconds in other.parts.items():
            self.parts[name] += seconds
        self.notes += [n for n in other.notes if n not in self.notes]
        self.device_hours += other.device_hours
        self.useful_device_hours += other.useful_device_hours
        kinds = {k for k in (self.device_kind, other.device_kind) if k}
        self.device_kind = "+".join(sorted(kinds))
        self.start = min((t for t in (self.start, other.start) if t is not None), default=None)
        ends = [t for t in (self.end, other.end) if t is not None]
        self.end = None if still_open else max(ends, default=None)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "other": self.other}

    def line(self) -> str:
        pct = (lambda s: f"{100 * s / self.wall:.0f}%") if self.wall > 0 else (lambda s: "-")
        shown = " ".join(f"{k}={v:.1f}s({pct(v)})" for k, v in self.parts.items() if v)
        sizes = [n for i, n in enumerate(self.ranks) if i == 0 or self.ranks[i - 1] != n]
        ranks = f" ranks={'>'.join(map(str, sizes))}" if sizes else ""
        hours = ""
        if self.device_kind:
            kind = self.device_kind.lower()
            hours = (f" {kind}_hours={self.device_hours:.3g}"
                     f" useful_{kind}_hours={self.useful_device_hours:.3g}")  # fmt: skip
        line = f"goodput: wall={self.wall:.1f}s {shown} other={self.other:.1f}s{ranks}{hours}"
        return line + "".join(f" [{n}]" for n in self.notes)


def container_seconds(run_dir: Path) -> float | None:
    """Container start time from container_start.json (one record, or one per restart)."""
    path = Path(run_dir) / runfiles.CONTAINER_START
    if not path.is_file():
        return None
    data = runfiles.read_json(path)
    records = data if isinstance(data, list) else [data]
    return sum(_start_seconds(r) for r in records if isinstance(r, dict))


def _start_seconds(record: dict[str, Any]) -> float:
    """One start: its `seconds`, or (the job script's record) the slowest node's cold start
    plus the slowest node's warm start, since the two srun steps run one after the other."""
    if "seconds" in record:
        return float(record["seconds"])
    nodes = [n for n in record.get("nodes", {}).values() if isinstance(n, dict)]
    return sum(
        max((float(n.get(k, 0.0)) for n in nodes), default=0.0) for k in ("cold_s", "warm_s")
    )


def from_trainer(run_dir: Path) -> Ledger:
    """The ledger from the trainer's records alone (no accounting: queue wait unknown)."""
    return assemble(read_rank0(run_dir), [], container_seconds(run_dir))


def read_rank0(run_dir: Path) -> list[dict[str, Any]]:
    return runfiles.read_metrics(run_dir, rank=0)


def segments(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's records cut at each trainer start: one segment per process."""
    out: list[dict[str, Any]] = []
    for rec in records:
        if rec.get("kind") == "timing" and rec.get("event") == "start":
            out.append({"start": rec, "steps": [], "spans": [], "end": None})
        elif out and rec.get("kind") == "step":
            out[-1]["steps"].append(rec)
        elif out and rec.get("kind") == "timing" and rec.get("event") in ("checkpoint", "eval"):
            out[-1]["spans"].append(rec)
        elif out and rec.get("kind") == "timing" and rec.get("event") == "end":
            out[-1]["end"] = rec
    return out


def _redone(segs: list[dict[str, Any]], i: int) -> int:
    """Steps of segment i that a later segment ran again (it resumed from an older step)."""
    later = [s["start"]["step"] for s in segs[i + 1 :]]
    return min(later, default=10**12)


def segment_parts(seg: dict[str, Any], resumed_at: int, start: float) -> dict[str, float]:
    """The parts of one process's time after its job started at `start`."""
    parts = dict.fromkeys(PARTS, 0.0)
    steps = seg["steps"]
    for rec in seg["spans"]:
        parts[rec["event"]] += float(rec["seconds"])
    for rec in steps:
        times = rec.get("time", {})
        wait = float(times.get("checkpoint_wait", 0.0))
        parts["checkpoint"] += wait
        name = "lost" if rec["step"] > resumed_at else "training"
        parts[name] += float(times.get("step", 0.0)) - wait
    if steps:  # the first step is start-up (compilation, first batch), not training
        first = steps[0]
        name = "lost" if first["step"] > resumed_at else "training"
        parts[name] -= float(first.get("time", {}).get("step", 0.0)) - float(
            first.get("time", {}).get("checkpoint_wait", 0.0)
        )
        parts["startup"] = float(first["wall_time"]) - start
    # The newest stamp: a span (an evaluation cut short by a failing peer) may end after the
    # last step; the time after it is shut-down (the job's End is added by the caller).
    stamps = [r["wall_time"] for r in (seg["start"], *steps, *seg["spans"], seg["end"] or {})
              if "wall_time" in r]  # fmt: skip
    parts["shutdown_at"] = float(max(stamps))
    return parts


def assemble(
    records: list[dict[str, Any]], attempts: list[Attempt], container_s: float | None
) -> Ledger:
    """The ledger of one run from rank 0's records and Slurm's attempts (none: no scheduler)."""
    segs = segments(records)
    ledger = Ledger()
    # One Slurm start holds several trainer starts when the job restarted its ranks in place
    # after a hang (templates/partials/watchdog.sh.j2).
    by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for s in segs:
        key = (str(s["start"].get("job_id")), s["start"].get("restart", 0))
        by_key.setdefault(key, []).append(s)
    pairs = [(a, by_key.get((a.job_id, a.restart), [])) for a in attempts]
    if not attempts:  # no accounting: each process's own clock bounds its part of the run
        ledger.notes.append("no Slurm accounting: queue wait unknown")
        # Paired by position: a run without a scheduler has no job id (its starts all read
        # job None, restart 0), so a key would fold its starts into one.
        pairs = [
            (Attempt(str(s["start"].get("job_id")), s["start"].get("restart", 0),
                     s["start"]["process_start"], s["start"]["process_start"], None), [s])
            for s in segs
        ]  # fmt: skip
    for attempt, group in pairs:
        ledger.add(_attempt_ledger(attempt, group, segs))
    if container_s is None:
        ledger.notes.append("no container_start.json: container start counted as 0")
    else:
        ledger.parts["container"] = container_s
        ledger.parts["startup"] -= container_s
    return ledger


def _attempt_ledger(attempt: Attempt, group: list[dict[str, Any]], segs: list[dict[str, Any]]
                    ) -> Ledger:  # fmt: skip
    """`group`: the trainer starts of this Slurm start (several after in-job restarts: the time
    from a hung start's last record to the next start counts as lost)."""
    one = Ledger(attempts=1)
    seg = group[0] if group else None
    if seg is not None and seg["steps"] and "world_size" in seg["steps"][0]:
        one.ranks = [int(seg["steps"][0]["world_size"])]
    start = attempt.start if attempt.start is not None else attempt.submit
    parts: dict[str, float] = {}
    shutdown_at = start
    for i, each in enumerate(group):
        begins = start if i == 0 else float(each["start"]["process_start"])
        own = segment_parts(each, _redone(segs, segs.index(each)), begins)
        if i > 0:
            own["lost"] += begins - shutdown_at
        shutdown_at = own.pop("shutdown_at", begins)
        for name, seconds in own.items():
            parts[name] = parts.get(name, 0.0) + seconds
    accounted = attempt.end if attempt.end is not None else max(shutdown_at, start)
    end = shutdown_at if shutdown_at - SLURM_RESOLUTION_S < accounted < shutdown_at else accounted
    one.wall = end - attempt.submit
    one.parts["queue"] = start - attempt.submit
    for name, seconds in parts.items():
        one.parts[name] += seconds
    one.parts["shutdown"] = end - shutdown_at
    if seg is None and attempt.start is not None:  # ended before the trainer started
        one.parts["startup"] = end - start
        one.parts["shutdown"] = 0.0
    one.start, one.end = attempt.start, attempt.end
    if attempt.devices and attempt.start is not None:
        one.device_kind = attempt.device_kind
        one.device_hours = attempt.devices * (accounted - attempt.start) / 3600
        one.useful_device_hours = attempt.devices * one.parts["training"] / 3600
    return one
