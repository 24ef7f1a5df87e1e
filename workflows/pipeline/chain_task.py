"""What every rank of a chain stage runs under submitit: the trainer, with signals forwarded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from vitpod.trainer.exitcodes import REQUEUE
from vitpod.workflows.planning.masterport import master_port
from vitpod.workflows.planning.spec import REQUEUE_MARKER_ENV

PREEMPT = (signal.SIGUSR2, signal.SIGTERM)  # trainer/exitcodes.py PREEMPT_SIGNALS
MAX_LOCAL_RESTARTS = 5  # without Slurm, an exit 75 restarts the trainer in place this often


@dataclass
class TrainerTask:
    """What submitit runs on every task: the trainer as a child process, logged per rank/restart.

    On Slurm the task already runs under the binding step (bind.sh is submitit's `python`), so
    ranks, binding, MASTER_ADDR/PORT and the requeue rule come from the same Launch as the
    sbatch path: exit 75 (trainer/exitcodes.py REQUEUE) ends the task with 75, bind.sh leaves the
    requeue marker and the batch script's teardown requeues the job. Without Slurm the trainer is
    restarted here (`--resume auto`).
    """

    command: list[str]
    log_dir: str
    cwd: str
    local: bool
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self) -> dict[str, Any]:
        job = submitit.JobEnvironment()
        env = {**os.environ, **self.env}
        if self.local:
            env.update(_local_rank_env(job))
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        while True:
            log = (
                Path(self.log_dir)
                / f"train-{job.job_id}-restart{restart}-rank{job.global_rank}.log"
            )
            rc = _run_forwarding_signals(self.command, env, log, self.cwd)
            if rc == REQUEUE and self.local and restart < MAX_LOCAL_RESTARTS:
                restart += 1
                continue
            break
        # A trainer killed by a signal after another rank asked for a requeue is not a failure.
        if rc == REQUEUE or (rc < 0 and _requeue_marker_left()):
            sys.exit(REQUEUE)  # no result file: the job is not over, the batch script requeues it
        if rc != 0:
            raise RuntimeError(
                f"rank {job.global_rank}: trainer exited with status {rc}; see {log}"
            )
        return {"rank": job.global_rank, "log": str(log), "restarts": restart}


def _requeue_marker_left() -> bool:
    """Whether some rank of this job (re)start left bind.sh's requeue marker (Slurm only)."""
    marker = os.environ.get(REQUEUE_MARKER_ENV, "")
    return bool(marker) and Path(marker).exists()


def _local_rank_env(job: submitit.JobEnvironment) -> dict[str, str]:
    # The local executor starts one process per task but sets only SUBMITIT_LOCAL_* variables.
    return {
        "RANK": str(job.global_rank),
        "LOCAL_RANK": str(job.local_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port(int(job.job_id))),
    }


def _run_forwarding_signals(cmd: list[str], env: dict[str, str], log: Path, cwd: str) -> int:
    """Run cmd with output to log; preemption signals go to it instead of submitit's handler.

    submitit's own USR2 handler would requeue at once, before the trainer has checkpointed. A
    signal that comes before the child exists is remembered: the child is then not started and
    REQUEUE returned (nothing trained yet); one that lands while it starts is delivered once it
    exists, and a child killed by it (before the trainer's handler was installed) counts as
    preempted too, as the trainer would have exited REQUEUE.
    """
    child: list[subprocess.Popen[bytes]] = []
    received: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        if child:
            child[0].send_signal(signum)
        else:
            pending.append(signum)

    previous = {s: signal.signal(s, forward) for s in PREEMPT}
    try:
        with open(log, "ab") as out:
            if received:
                return REQUEUE
            child.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=out))
        for signum in pending:  # landed while Popen ran, before the handler could see a child
            child[0].send_signal(signum)
        rc = child[0].wait()
        return REQUEUE if received and -rc in PREEMPT else rc
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
