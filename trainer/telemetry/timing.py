"""What only the trainer can time, stamped when it happens: `kind: "timing"` metrics records."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def process_start_time() -> float:
    """Unix time this process started (from /proc: before Python, torch and timm were imported)."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot (proc(5), field 22)
        boot = next(
            float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class TimingLog:
    """Writes timing records through `write`; sums the time the loop waited on checkpoints. A
    `heartbeat` (the job's watchdog) is told each timed section and the run's end."""

    def __init__(
        self,
        write: Callable[[dict[str, Any]], None],
        heartbeat: Any = None,  # a Heartbeat
    ) -> None:
        self._write = write
        self.heartbeat = heartbeat
        self.fence_s = 0.0  # checkpoint host-copy waits inside steps since the last record

    def start(self, step: int) -> None:
        """A (re)start of the trainer: job, restart count and when the process began."""
        self._write({
            "kind": "timing", "event": "start", "step": step, "wall_time": time.time(),
            "process_start": process_start_time(), "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "attempt": int(os.environ.get("VITPOD_ATTEMPT") or 0),  # in-job restarts (hangs)
        })  # fmt: skip

    def span(self, event: str, step: int, seconds: float) -> None:
        """An `event` ("checkpoint", "eval") that held the loop for `seconds`, ending now."""
        self._write({"kind": "timing", "event": event, "step": step, "seconds": seconds,
                     "wall_time": time.time()})  # fmt: skip

    def end(self, step: int, outcome: str) -> None:
        self._write({"kind": "timing", "event": "end", "step": step, "outcome": outcome,
                     "wall_time": time.time()})  # fmt: skip
        if self.heartbeat is not None:
            self.heartbeat.close()

    @contextmanager
    def timed(self, event: str, step: int) -> Iterator[None]:
        start = time.perf_counter()
        try:
            if self.heartbeat is None:
                yield
            else:
                with self.heartbeat.during(event, step):
                    if event == "checkpoint":
                        self.heartbeat.block_save_for_test(step)
                    yield
        finally:
            self.span(event, step, time.perf_counter() - start)

    def fence(self, wait: Callable[[], None]) -> None:
        """Run the checkpointer's fence, adding the time it blocked the step."""
        start = time.perf_counter()
        wait()
        self.fence_s += time.perf_counter() - start

    def take_fence_s(self) -> float:
        """Checkpoint waits since the last call (the step that just ended waited this long)."""
        waited, self.fence_s = self.fence_s, 0.0
        return waited
