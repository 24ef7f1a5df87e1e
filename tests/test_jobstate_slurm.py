"""Batched job state against the real local Slurm, with and without accounting (slurmdbd)."""

import subprocess
import time

import pytest

from tests.fixtures_slurm import restart_slurm, stop_slurmdbd
from tests.helpers import wait_until
from vitpod.workflows import slurm
from vitpod.workflows.jobs import jobstate


def _sbatch(*args: str) -> str:
    cmd = ["sbatch", "--parsable", "-o", "/dev/null", "-J", "jobstate-test", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def _count_calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = slurm.runner

    def counting(argv, **kwargs):
        calls.append(argv[0])
        return real(argv, **kwargs)

    monkeypatch.setattr(slurm, "runner", counting)
    return calls


@pytest.mark.slurm
def test_one_squeue_per_poll_and_completed_state(local_slurm, monkeypatch):
    first = _sbatch("-p", "pretrain", "--wrap", "true")
    second = _sbatch("-p", "finetune", f"--dependency=afterok:{first}", "--wrap", "true")
    calls = _count_calls(monkeypatch)
    poller = jobstate.JobStatePoller([first, second])
    infos = jobstate.wait_jobs(poller, timeout=90, poll_s=0.5)
    assert [i.state for i in infos.values()] == ["COMPLETED", "COMPLETED"]
    polls = calls.count("squeue")
    assert polls >= 1 and calls.count("sacct") == 0  # squeue still knew both jobs
    assert len(calls) == polls


@pytest.mark.slurm
def test_cancelled_job_fails_wait_without_accounting(local_slurm, monkeypatch):
    job = _sbatch("-p", "pretrain", "--wrap", "sleep 300")
    dependent = _sbatch("-p", "finetune", f"--dependency=afterok:{job}", "--wrap", "true")
    stop_slurmdbd()
    try:
        with pytest.raises(slurm.SlurmError, match=r"^`sacct .*` failed \(exit"):
            jobstate.sacct([job])  # accounting really is down
        calls = _count_calls(monkeypatch)
        poller = jobstate.JobStatePoller([job, dependent, "999999"], sacct_retry_s=3600)
        infos = poller.poll()
        assert infos[job].state in ("PENDING", "RUNNING")
        assert infos[dependent].reason == "Dependency"
        assert infos["999999"].state == jobstate.GONE and poller.accounting is False

        subprocess.run(["scancel", job], check=True)
        poller.job_ids = [job, dependent]
        start = time.monotonic()
        with pytest.raises(jobstate.JobFailedError, match=f"job {job} ended CANCELLED"):
            jobstate.wait_jobs(poller, timeout=60, poll_s=1)
        assert time.monotonic() - start < 60
        assert calls.count("sacct") == 1  # tried once, then left alone: no hammering

        # A job nobody knows any more ends the wait too, instead of hanging.
        with pytest.raises(jobstate.JobFailedError, match="final state is unknown"):
            jobstate.wait_jobs(jobstate.JobStatePoller(["999999"]), timeout=30, poll_s=0.2)
    finally:
        subprocess.run(["scancel", job, dependent], check=False)
        restart_slurm()
    # slurmctld sends the records it kept while slurmdbd was down once they reconnect (seconds)
    wait_until(f"job {job} in accounting again", lambda: job in jobstate.sacct([job]), 90, 1)
    assert job in jobstate.sacct([job])
