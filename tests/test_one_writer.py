"""One writer per run, from the submission side.

- `--resume` in ARGS is refused as a user types it (`make render ARGS="--resume /x"`): exit 2,
  one line naming `make resume RUN=` and FINETUNE_FROM=, no run directory.
- `make resume` on the real local Slurm while the run's job is still pending: exit 2 naming the
  job, its state and the fix, job.sbatch and bind.sh untouched (bytes and mtime); with CANCEL=1
  it cancels the job, waits until it has left the queue, then submits.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures_slurm import LocalSlurm, queue_state
from tests.helpers import make
from vitpod.registry import runfiles
from vitpod.workflows.jobs.runjobs import run_job_ids
from vitpod.workflows.site.profile import PROFILE_DIR


def _make(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return make(*args, runs=tmp_path / "runs", timeout=timeout)


@pytest.mark.parametrize("resume", ["--resume /x", "--resume=none", "--resume auto"])
def test_resume_in_args_exits_2_with_the_fix_and_writes_no_run_dir(tmp_path, resume):
    out = _make(tmp_path, "render", "CLUSTER=localslurm", "MODEL=volo_tiny", f"ARGS={resume}")
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert "ARGS: --resume is set by vitpod" in line
    assert "make resume RUN=<run dir>" in line and "FINETUNE_FROM=" in line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_job_ids_of_every_restart_are_the_runs(tmp_path):
    (tmp_path / "manifest.restart2.json").write_text(json.dumps({"job_ids": ["12"]}))
    (tmp_path / "manifest.restart1.json").write_text(json.dumps({"job_ids": ["11"]}))
    (tmp_path / "manifest.restart10.json").write_text("{trunc")  # unreadable: names none
    (tmp_path / runfiles.MANIFEST).write_text(json.dumps({"job_ids": ["13", "12"]}))
    assert run_job_ids(tmp_path) == ["11", "12", "13"]


def _stamp(run: Path) -> dict[str, tuple[bytes, int]]:
    names = (runfiles.SBATCH, "bind.sh", runfiles.PLAN, runfiles.MANIFEST)
    return {n: ((run / n).read_bytes(), (run / n).stat().st_mtime_ns) for n in names}


@pytest.mark.slurm
def test_resume_refuses_while_the_runs_job_is_pending_and_cancels_it_with_cancel_1(
    local_slurm: LocalSlurm, digits_dir: Path, tmp_path: Path
) -> None:
    profile = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    profile["storage"] = {**profile["storage"], "data": str(digits_dir.parent)}
    path = tmp_path / "localslurm.yaml"
    path.write_text(yaml.safe_dump(profile))
    rendered = _make(tmp_path, "render", f"CLUSTER={path}", "MODEL=volo_tiny", "ARGS=--epochs 1")
    assert rendered.returncode == 0, rendered.stderr
    run = Path(rendered.stdout.strip().splitlines()[-1]).parent
    # The run's job, held in the queue as after a requeue (pending until released).
    held = subprocess.run(["sbatch", "--hold", "--parsable", str(run / runfiles.SBATCH)],
                          cwd=run, capture_output=True, text=True, check=True)  # fmt: skip
    job = held.stdout.strip().split(";")[0]
    submitted: list[str] = [job]
    try:
        manifest = json.loads((run / runfiles.MANIFEST).read_text())
        (run / runfiles.MANIFEST).write_text(json.dumps({**manifest, "job_ids": [job]}))
        assert queue_state(job) == "PENDING"
        before = _stamp(run)
        refused = _make(tmp_path, "resume", f"RUN={run}")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        (line,) = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
        assert f"job {job} is PENDING" in line
        assert f"scancel {job}" in line and "CANCEL=1" in line
        assert _stamp(run) == before, "a refused resume rewrote the run directory"
        assert not list(run.glob("*.restart*")) and queue_state(job) == "PENDING"

        resumed = _make(tmp_path, "resume", f"RUN={run}", "CANCEL=1")
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        new = re.search(r"submitted batch job (\d+)", resumed.stdout)
        assert new, resumed.stdout
        submitted.append(new[1])
        assert f"cancelled {job}" in resumed.stdout
        assert queue_state(job) in ("", "CANCELLED"), "the earlier job is still queued"
        assert (run / "job.restart1.sbatch").read_bytes() == before[runfiles.SBATCH][0]
        assert json.loads((run / runfiles.MANIFEST).read_text())["job_ids"] == [new[1]]
        assert run_job_ids(run) == [job, new[1]]
    finally:
        subprocess.run(["scancel", *submitted], check=False)
