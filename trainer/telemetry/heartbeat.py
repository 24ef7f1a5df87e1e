"""A rank's heartbeat for the job's watchdog (templates/partials/watchdog.sh.j2, docs/hangs.md).

A thread rewrites HEARTBEATS/rank<R> every BEAT_S seconds with one line:

    rank host pid step section since_ms deadline beat

`section` is what the rank is doing (startup, step, compile, checkpoint, eval; done at the end),
`since_ms` when it began (Unix milliseconds: the rank longest in its section is the one named),
`deadline` the Unix second by which it must be over (0: none) and `beat` when the thread last
wrote: a rank blocked in a collective keeps beating, a stopped or dead process does
not. A section's timeout is 2 x its running estimate + the floor, at most its ceiling (plan.json
`hang`): the step's estimate is the median of this run's recent steps, a save's and an
evaluation's the longest this run (else the last run) measured.

When the watchdog asks (HEARTBEATS/dump exists), the thread writes every thread's Python stack
of this rank to its log (faulthandler) and, on NCCL, torch's flight recorder of the collectives
in flight; a stopped process cannot, the watchdog dumps it from outside with py-spy.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vitpod.trainer.telemetry.timing import process_start_time

DIR_ENV = "VITPOD_HEARTBEATS"  # set by job.sbatch when its watchdog runs
ATTEMPT_ENV = "VITPOD_ATTEMPT"  # the in-job restart (0: the first start of this Slurm start)
TEST_BLOCK_SAVE_ENV = "VITPOD_TEST_BLOCK_SAVE"  # "RANK:STEP:ATTEMPT": that save blocks
BEAT_S = 2.0
RECENT_STEPS = 20


def timeout(floor_s: float, ceiling_s: float, measured_s: float | None) -> float:
    """2 x measured + floor, at most the ceiling; the ceiling while nothing is measured (the
    planner's rule too: workflows/planning/hangplan.py)."""
    return ceiling_s if measured_s is None else min(ceiling_s, 2 * measured_s + floor_s)


class Heartbeat:
    """Off (every method a no-op) unless `directory` is given."""

    def __init__(self, directory: Path | None, rank: int, limits: dict[str, Any] | None) -> None:
        self.directory, self.rank = directory, rank
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # Slurm's name
        limits = limits or {}
        self.floor_s = float(limits.get("floor_s", 300.0))
        self.ceilings = {k: float(v) for k, v in limits.get("ceilings_s", {}).items()}
        self.measured: dict[str, float | None] = dict(limits.get("measured_s", {}))
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.step, self.section = 0, "startup"
        self.since = process_start_time()
        self.deadline = self.since + self.timeout("startup")
        self.last_boundary: float | None = None
        self.compiled = False  # the trainer's torch.compile decision (--compile)
        self.shapes: set[Any] = set()  # the input shapes the compiled model has run
        self._stop = threading.Event()
        self._dumped = 0.0
        self._thread: threading.Thread | None = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"rank{rank}"
            self._beat()
            self._thread = threading.Thread(target=self._run, name="vitpod-heartbeat", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, run_dir: Path, rank: int) -> Heartbeat:
        """On when job.sbatch's watchdog set VITPOD_HEARTBEATS; limits from RUN/plan.json."""
        directory = os.environ.get(DIR_ENV)
        if not directory:
            return cls(None, rank, None)
        try:
            limits = json.loads((run_dir / "plan.json").read_text()).get("hang")
        except (OSError, ValueError):
            limits = None
        return cls(Path(directory), rank, limits)

    def timeout(self, section: str) -> float:
        section = "startup" if section == "compile" else section  # a compile, as at start-up
        ceiling = self.ceilings.get(section, 3600.0)
        return timeout(self.floor_s, ceiling, self.measured.get(section))

    def enter(self, section: str, step: int) -> None:
        now = time.time()
        self.step, self.section, self.since = step, section, now
        self.deadline = now + self.timeout(section)
        if self._thread is not None:  # at once: a rank stopped right after names this section
            self._beat()

    def stepped(self, step: int) -> None:
        """A step ended: its wall time (boundary to boundary) joins the running estimate."""
        now = time.time()
        if self.last_boundary is not None and self.section == "step":
            self.recent.append(now - self.last_boundary)
            self.measured["step"] = statistics.median(self.recent)
        self.last_boundary = now
        self.enter("step", step)

    def compiling(self, step: int) -> None:
        """With --compile on, a step whose input shape is new (an epoch's last, partial batch)
        recompiles, minutes cold: it runs under the start-up's timeout, not the step's, and its
        time stays out of the step estimate. In start-up already: nothing changes."""
        if self.section == "step":
            self.enter("compile", step)

    def batches(self, loader: Iterable[Any], step: Callable[[], int]) -> Iterator[Any]:
        """The loader's (images, targets), telling `compiling` of each new images shape while
        the model is compiled."""
        for batch in loader:
            if self.compiled and batch[0].shape not in self.shapes:
                self.shapes.add(batch[0].shape)
                self.compiling(step())
            yield batch

    @contextmanager
    def during(self, name: str, step: int) -> Iterator[None]:
        """A save or an evaluation; afterwards the rank is back in what it did before."""
        before, started = self.section, time.time()
        self.enter(name, step)
        try:
            yield
        finally:
            took = time.time() - started
            self.measured[name] = max(took, self.measured.get(name) or 0.0)
            self.enter(before, step)
            self.last_boundary = None  # the next step's time does not hold the save's

    def block_save_for_test(self, step: int) -> None:
        """The test-only hook: VITPOD_TEST_BLOCK_SAVE=RANK:STEP:ATTEMPT makes that rank's save
        at that step block forever in that in-job attempt (tests/test_hang_slurm.py)."""
        attempt = os.environ.get(ATTEMPT_ENV, "0")
        if os.environ.get(TEST_BLOCK_SAVE_ENV) == f"{self.rank}:{step}:{attempt}":
            print(f"test hook: rank {self.rank} blocks its save at step {step}", file=sys.stderr)
            threading.Event().wait()

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=5)
        self.section, self.deadline = "done", 0.0
        self._beat()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._beat()
            self._dump_if_asked()

    def _beat(self) -> None:
        assert self.directory is not None
        line = (f"{self.rank} {self.node} {os.getpid()} {self.step} {self.section} "
                f"{int(self.since * 1000)} {int(self.deadline)} {int(time.time())}\n")  # fmt: skip
        tmp = self.path.with_name(f"{self.path.name}.{threading.get_ident()}.tmp")  # 2 writers
        try:
            tmp.write_text(line)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full or flaky disk: the watchdog sees the beat age and says so

    def _dump_if_asked(self) -> None:
        assert self.directory is not None
        try:
            asked = (self.directory / "dump").stat().st_mtime
        except OSError:
            return
        if asked <= self._dumped:
            return
        self._dumped = asked
        sys.stderr.write(f"vitpod: watchdog: stacks of rank {self.rank} (pid {os.getpid()}) "
                         f"in {self.section} at step {self.step}:\n")  # fmt: skip
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _dump_flight_recorder(self.directory.parent / f"nccl-trace-rank{self.rank}.pkl")
        (self.directory / f"dumped-rank{self.rank}").touch()


def _dump_flight_recorder(path: Path) -> None:
    """NCCL only: torch's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE > 0) names the
    collectives each rank entered; gloo has none."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return
        path.write_bytes(torch._C._distributed_c10d._dump_nccl_trace())
    except Exception as exc:  # a build without the recorder: the stacks are still written
        sys.stderr.write(f"vitpod: watchdog: no NCCL flight recorder dump ({exc})\n")
