"""A preemption signal before the trainer starts, on the real local Slurm (issue 30, item 6).

A job submitted as a user does (`vitpod submit`) whose ranks are still in the step before the
trainer (a stand-in `python` that waits on its first start, as a slow import or container start
would) is signalled with `scancel --full --signal=USR2`: every process of the job gets it, the
batch script included. Before this change the batch script died of it and the job FAILED (rc
140, no requeue marker). Now the batch script and bind.sh trap it from their first lines: the
rank counts as preempted (exit 75, marker), the job requeues, and the restart runs the command
and completes. The cases without Slurm (a signal while the batch script runs a step before the
ranks, the requeue bound) are in tests/test_requeue_bound.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures_slurm import job_restarts
from tests.helpers import submitted, vitpod, wait_until
from vitpod.workflows.site.profile import PROFILE_DIR

pytestmark = [pytest.mark.slurm]


def _slow_first_start_python(tmp_path: Path) -> Path:
    """A `python` whose first start waits (ready-<rank> tells the test) before the real one."""
    path = tmp_path / "python-slow-first-start"
    path.write_text(
        "#!/bin/bash\n"
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        f'  touch {tmp_path}/ready-"$SLURM_PROCID"\n'
        "  sleep 60\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return path


def test_usr2_before_the_trainer_starts_requeues_and_completes(local_slurm, tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["python"] = str(_slow_first_start_python(tmp_path))
    profile = tmp_path / "slow-start.yaml"
    profile.write_text(yaml.safe_dump(data))
    argv = ["submit", "--cluster", str(profile), "--model", "volo_tiny", "--entry", "rankinfo"]
    job, run = submitted(vitpod(*argv, "--nodes", "1", runs=tmp_path / "runs", timeout=120))

    def ready() -> bool:
        return all((tmp_path / f"ready-{r}").exists() for r in (0, 1))

    wait_until(f"job {job}'s ranks to start", ready, 120, interval=0.2)
    subprocess.run(["scancel", "--full", "--signal=USR2", job], check=True, timeout=30)
    assert local_slurm.wait(job, timeout=120) == "COMPLETED"

    first = (run / "logs" / f"sbatch-{job}-restart0.log").read_text()
    logs = "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(run.glob("logs/*restart0*")))
    assert "vitpod: SIGUSR2 received at" in first and "(ranks)" in first, logs
    assert f"preempted (srun exit 75); requeueing job {job}" in first, logs
    rank0 = (run / "logs" / f"train-{job}-restart0-rank0.log").read_text()
    assert "bind: rank 0: SIGUSR2 before the command could checkpoint (exit 140); requeue" in rank0
    assert (run / "logs" / f"requeue-{job}-restart0").exists()
    second = (run / "logs" / f"sbatch-{job}-restart1.log").read_text()
    assert "srun exited with status 0" in second, second
    assert job_restarts(job) in (None, 1)  # None: already purged
    assert (run / "requeue-progress").read_text() == f"{job} -1 1\n"
    assert os.path.getsize(run / "logs" / f"train-{job}-restart1-rank0.log") > 0
