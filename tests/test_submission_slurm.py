"""sbatch outcomes: a timeout keeps the run directory (the job may be queued), a rejection not."""

from __future__ import annotations

import subprocess

import pytest

from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.submit import slurm, submission


def _script(tmp_path, partition: str = "pretrain"):
    plan = plan_job(Request(cluster="localslurm", run_root=str(tmp_path / "runs")))
    script = submission.materialize(plan)
    if partition != "pretrain":
        text = script.read_text().replace("--partition=pretrain", f"--partition={partition}")
        script.write_text(text)
    return plan, script


def test_sbatch_timeout_keeps_run_dir_and_says_how_to_check(local_slurm, tmp_path, monkeypatch):
    plan, script = _script(tmp_path)
    monkeypatch.setitem(slurm.TIMEOUT_S, "sbatch", 0.001)
    try:
        with pytest.raises(submission.SbatchUnanswered) as caught:
            submission.sbatch_run(script)
    finally:  # it may have been queued after all
        subprocess.run(["scancel", "--name", plan.spec.job_name], timeout=30, check=False)
    message = str(caught.value)
    assert script.parent.is_dir() and script.is_file()
    assert "may be queued" in message and f"squeue --me --name {plan.spec.job_name}" in message
    assert "\n" not in message


def test_sbatch_rejection_removes_run_dir(local_slurm, tmp_path):
    _, script = _script(tmp_path, partition="nosuch")
    with pytest.raises(
        ConfigError, match=r"^`sbatch --parsable .*` failed \(exit 1: .*partition"
    ) as caught:
        submission.sbatch_run(script)
    assert not isinstance(caught.value, submission.SbatchUnanswered)
    assert not script.parent.exists()
