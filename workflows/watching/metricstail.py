"""A run's newest step, loss, images/s and ETA from its metrics JSONL, reading only new lines."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles

# Steps of rank 0 the pace (and so the ETA) is measured over: more than an epoch, so the pace
# includes the evaluation and checkpoint at an epoch's end that the steps left will meet too.
ETA_WINDOW = 500


class MetricsTail:
    """The newest step of a run from its metrics/rank*.jsonl, reading only appended lines."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.files: dict[Path, runfiles.JsonlTail] = {}
        self.step: int | None = None
        self.total: int | None = None
        self.loss: float | None = None
        self.rank_ips: dict[int, float] = {}
        self.rank_wall: dict[str, float] = {}  # each rank's newest step end (a hang shows here)
        self.top1: float | None = None
        self.summary_ips: float | None = None
        self.summary_mfu: float | None = None
        self.flops_per_step: float | None = None  # rank 0's start-up "mfu" record
        self.peak_flops: float | None = None
        self.done = False
        # (step, wall time) of rank 0's recent steps; cleared when a restart goes back in steps.
        self.recent: deque[tuple[int, float]] = deque(maxlen=ETA_WINDOW)
        self.step_s: deque[float] = deque(maxlen=ETA_WINDOW)

    def update(self) -> None:
        """Take the lines appended since the last update (a line being written now is read on
        the next one); RunFileError on a damaged line."""
        for path in runfiles.metrics_files(self.run_dir):
            tail = self.files.setdefault(path, runfiles.JsonlTail(path))
            try:
                records = tail.read()
            except OSError:
                continue
            for record in records:
                self._take(record)

    def _take(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == "summary":
            self.done = True
            self.top1 = rec.get("top1", self.top1)
            self.summary_ips = rec.get("images_per_s")
            self.summary_mfu = rec.get("mfu")
            self.step = rec.get("steps", self.step)
            return
        if kind == "eval":
            self.top1 = rec.get("top1")
            return
        if kind == "mfu":
            self.flops_per_step, self.peak_flops = rec.get("flops_per_step"), rec.get("peak_flops")
            return
        if kind != "step":
            return
        rank, step = int(rec.get("rank", 0)), int(rec["step"])
        self.rank_ips[rank] = float(rec.get("images_per_s", 0.0))
        if "wall_time" in rec:
            self.rank_wall[f"rank{rank}"] = float(rec["wall_time"])
        if rank != 0:
            return
        if self.step is not None and step < self.step:  # resumed from an older checkpoint
            self.recent.clear()
            self.step_s.clear()
        self.step, self.loss = step, rec.get("loss")
        self.total = rec.get("total_steps", self.total)
        if "wall_time" in rec:
            self.recent.append((step, float(rec["wall_time"])))
        self.step_s.append(float(rec.get("time", {}).get("step", 0.0)))

    @property
    def images_per_s(self) -> float | None:
        if self.summary_ips is not None:
            return float(self.summary_ips)
        return sum(self.rank_ips.values()) if self.rank_ips else None

    @property
    def mfu(self) -> float | None:
        """The summary's MFU, else rank 0's recent step times against its device's peak."""
        if self.done:
            return self.summary_mfu
        step_s = [s for s in self.step_s if s > 0]
        if not (self.flops_per_step and self.peak_flops and step_s):
            return None
        return self.flops_per_step * len(step_s) / sum(step_s) / self.peak_flops

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds left at the recent pace (wall clock, so data loading and checkpoints count).

        The steps are stamped when they end but written in batches (every --log-interval
        steps): the time since the newest written step's stamp has already been spent on the
        steps not written yet, so it is taken off."""
        if self.done or (self.step is not None and self.total and self.step >= self.total):
            return 0.0  # finished, or past its last step (final eval, saving)
        if self.step is None or not self.total:
            return None
        left = self.total - self.step
        if len(self.recent) >= 2 and self.recent[-1][0] > self.recent[0][0]:
            (s0, t0), (s1, t1) = self.recent[0], self.recent[-1]
            since = max(0.0, (time.time() if now is None else now) - t1)
            return max(0.0, left * (t1 - t0) / (s1 - s0) - since)
        if self.step_s:  # an older trainer without wall_time: the measured step time
            return left * sum(self.step_s) / len(self.step_s)
        return None


def newest_checkpoint_age(run_dir: Path, now: float) -> float | None:
    """Seconds since the newest complete checkpoint was committed (None: none yet)."""
    times = [
        p.stat().st_mtime
        for p in (run_dir / runfiles.CHECKPOINTS).glob(f"*/{runfiles.CHECKPOINT_COMMIT}")
        if runfiles.is_checkpoint_name(p.parent.name)
    ]
    return now - max(times) if times else None


def duration(seconds: float | None) -> str:
    """H:MM:SS (M:SS under an hour); "-" for None."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
