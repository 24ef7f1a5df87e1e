"""A preemption signal to a chain rank task is never lost, even before its trainer exists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers import wait_until
from vitpod.trainer.exitcodes import REQUEUE

# The task runs _run_forwarding_signals with its log on a FIFO: opening it blocks (handlers
# installed, no child yet) until the test opens the reading end, so a signal lands exactly there.
TASK = """
import sys
from vitpod.workflows.pipeline.chain_task import _run_forwarding_signals
print("ready", flush=True)
sys.exit(_run_forwarding_signals(sys.argv[2:], {}, sys.argv[1], "."))
"""
CHILD = [sys.executable, "-c", "import sys, time; print('started', flush=True); time.sleep(60)"]


def _task(log, child=CHILD) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", TASK, str(log), *child], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_signal_before_the_trainer_starts_requeues_without_starting_it(tmp_path):
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    task = _task(fifo)
    time.sleep(0.5)  # the task now blocks in open(fifo) with its handlers installed
    task.send_signal(signal.SIGUSR2)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert task.wait(timeout=30) == REQUEUE
        assert os.read(reader, 100) == b""  # the trainer never started
    finally:
        os.close(reader)


def test_signal_that_kills_a_starting_trainer_counts_as_preemption(tmp_path):
    log = tmp_path / "train.log"
    task = _task(log)  # the child installs no handler: USR2 kills it, as during its imports
    wait_until("the child to start", lambda: log.exists() and "started" in log.read_text(), 30)
    task.send_signal(signal.SIGUSR2)
    assert task.wait(timeout=30) == REQUEUE


def test_child_exit_status_passes_through_without_a_signal(tmp_path):
    task = _task(tmp_path / "train.log", [sys.executable, "-c", "raise SystemExit(3)"])
    assert task.wait(timeout=30) == 3
