"""sbatch outcomes through the one submission function: a timeout keeps the run directory (the
job may be queued), a rejection of a run written just now removes it; and `vitpod submit RUN_DIR`
submits a rendered run as it is, after the live preflight, refusing a file changed since."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.test_run_modes import umask, wider_than_private
from vitpod.workflows import cli, slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.submit import submission


def _script(tmp_path, partition: str = "pretrain"):
    plan = plan_job(Request(cluster="localslurm", run_root=str(tmp_path / "runs")))
    script = submission.materialize(plan)
    if partition != "pretrain":
        text = script.read_text().replace("--partition=pretrain", f"--partition={partition}")
        script.write_text(text)
        # a deliberate change, recorded as rendered: this test is about sbatch's refusal
        submission.record_checksums(script.parent, [script, script.parent / "bind.sh",
                                                    script.parent / "plan.json"])  # fmt: skip
    return plan, script


def _queued(job: str) -> bool:
    done = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=30)
    return bool(done.stdout.strip())


def _submit(script):
    return submission.submit(script, {}, remove_on_refusal=True)


def test_sbatch_timeout_keeps_run_dir_and_says_how_to_check(local_slurm, tmp_path, monkeypatch):
    plan, script = _script(tmp_path)
    monkeypatch.setitem(slurm.TIMEOUT_S, "sbatch", 0.001)
    try:
        with pytest.raises(submission.SbatchUnanswered) as caught:
            _submit(script)
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
        _submit(script)
    assert not isinstance(caught.value, submission.SbatchUnanswered)
    assert not script.parent.exists()


def test_vitpod_submit_runs_the_rendered_run_as_rendered(local_slurm, tmp_path, capsys):
    """make render, review, make submit RUN=...: Slurm holds the reviewed bytes; a second
    submission of the same run is refused (it has a job id)."""
    runs = tmp_path / "runs"
    argv = ["--cluster", "localslurm", "--entry", "rankinfo", "--nodes", "1",
            "--run-root", str(runs), "--time", "0:03:00"]  # fmt: skip
    assert cli.main(["render", *argv]) == 0
    script = Path(capsys.readouterr().out.splitlines()[-1])
    reviewed = script.read_bytes()
    with umask(0o002):  # a group-writable umask: the job still writes nothing group-writable
        assert cli.main(["submit", str(script.parent)]) == 0
    out = capsys.readouterr().out
    job = out.split("submitted batch job ")[1].split()[0]
    try:
        held = subprocess.run(["scontrol", "write", "batch_script", job, "-"],
                              capture_output=True, check=True).stdout  # fmt: skip
        assert held == reviewed and b"#SBATCH --time=0:03:00" in held
        assert "ok: sbatch --test-only accepts the script" in out  # the live preflight ran
        assert json.loads((script.parent / "manifest.json").read_text())["job_ids"] == [job]
        assert cli.main(["submit", str(script.parent)]) == 2
        assert f"was already submitted (job {job})" in capsys.readouterr().err
        wait_until(f"job {job} to end", lambda: not _queued(job), timeout=120, interval=0.5)
        assert list((script.parent / "logs").iterdir())  # Slurm's log, written by the job
        assert wider_than_private(script.parent) == []
        with umask(0o002):  # resubmitted by hand (the docs' `sbatch RUN/job.sbatch`): the same
            again = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                                   text=True, check=True).stdout.strip()  # fmt: skip
        job = again.split(";")[0]
        wait_until(f"job {job} to end", lambda: not _queued(job), timeout=120, interval=0.5)
        assert wider_than_private(script.parent) == []
    finally:
        subprocess.run(["scancel", job], timeout=30, check=False)


def test_a_rendered_labeling_array_is_not_said_to_differ(
    local_slurm, tmp_path, monkeypatch, capsys
):
    """A rendered pipeline with TEACHER=: its labeling array planned again against the live
    cluster renders the kept array script, so no `would differ` note (every label array had one:
    the plan again was compared as a single job; found verifying issue 43). Nothing is queued."""
    from vitpod.workflows.pipeline import chain_submit
    from vitpod.workflows.pipeline.chain import Chain

    teacher = tmp_path / "teacher.pt"
    teacher.write_bytes(b"weights")  # a bare weights file: not opened at planning
    labels = f"--token-label --token-label-size 2 --token-label-data {tmp_path / 'labels'}"
    chain = Chain("localslurm", "volo_tiny", nodes=1, teacher=str(teacher), offline=True,
                  run_root=str(tmp_path / "runs"), pretrain_args=labels,
                  finetune_args="--no-token-label")  # fmt: skip
    assert "labels-pretrain" in chain.render()
    launched: list[bool] = []  # after every stage's plan again and preflight; no sbatch
    monkeypatch.setattr(chain_submit, "launch", lambda chain, owned: launched.append(owned))
    assert chain.directory is not None
    Chain.from_dir(chain.directory).submit()
    assert launched == [False] and "would differ" not in capsys.readouterr().out
