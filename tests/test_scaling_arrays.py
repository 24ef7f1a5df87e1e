"""Job arrays: task ids in the batched job state; a sweep point's rank's requeue marker honoured."""

import json

import pytest
import yaml

from tests.fixtures_slurm import preempted_once_python
from vitpod.workflows import slurm
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.jobstate import task_ids, wait_array, wait_finished
from vitpod.workflows.site.profile import PROFILE_DIR
from vitpod.workflows.studies.scaling import build_parser, materialize, prepare
from vitpod.workflows.submit.submission import sbatch


def test_array_task_ids_are_expanded():
    assert jobstate.expand_job_id("138_[0-2%1]") == ["138_0", "138_1", "138_2"]
    assert jobstate.expand_job_id("138_[0,2-3]") == ["138_0", "138_2", "138_3"]
    assert jobstate.expand_job_id("138_4") == ["138_4"] and jobstate.expand_job_id("7") == ["7"]
    squeue = "138_[1-2%1]|PENDING|JobArrayTaskLimit|0|0\n138_0|RUNNING|None|0|0\n"
    infos = jobstate.squeue_infos(slurm.parsable(squeue, jobstate.SQUEUE_FIELDS, strip=True))
    assert {j: i.state for j, i in infos.items()} == {
        "138_1": "PENDING",
        "138_2": "PENDING",
        "138_0": "RUNNING",
    }
    sacct = "138_0|COMPLETED|0:0|None\n138_1|FAILED|3:0|None\n138_1.batch|FAILED|3:0|\n"
    rows = slurm.parsable(sacct, jobstate.SACCT_FIELDS)
    assert {j: i.state for j, i in jobstate.sacct_infos(rows).items()} == {
        "138_0": "COMPLETED",
        "138_1": "FAILED",
    }


@pytest.mark.slurm
def test_throttled_array_tasks_are_polled_to_their_end(local_slurm, tmp_path):
    script = tmp_path / "array.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --array=0-2%1\n#SBATCH --partition=pretrain\n"
        f"#SBATCH --output={tmp_path}/o-%A_%a.out\n"
        '[ "$SLURM_ARRAY_TASK_ID" = 1 ] && exit 3\nexit 0\n'
    )
    job = sbatch(script)
    ids = task_ids(job, 3)
    first = jobstate.poll_once(ids)  # tasks 1 and 2 still share one pending line
    assert set(first) == set(ids) and all(i.state != jobstate.GONE for i in first.values())
    assert wait_array(job, 3, timeout=90, poll_s=0.5) == {
        0: "COMPLETED",
        1: "FAILED",
        2: "COMPLETED",
    }


@pytest.mark.slurm
@pytest.mark.slow
def test_sweep_point_requeues_on_a_ranks_marker(local_slurm, tmp_path):
    wrapper = preempted_once_python(tmp_path / "python-preempted-once", then="exit 0")
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["python"] = str(wrapper)
    data["storage"] = {**data["storage"], "data": str(tmp_path)}
    (tmp_path / "digits").mkdir()
    profile = tmp_path / "preempted.yaml"
    profile.write_text(yaml.safe_dump(data))
    study_dir = tmp_path / "study"
    ns = build_parser().parse_args(
        ["--cluster", str(profile), "--model", "volo_tiny", "--mode", "weak", "--gpus", "2"]
        + ["--batch", "8", "--study-dir", str(study_dir)]
    )
    (script,) = materialize(prepare(ns))
    job = sbatch(script)
    infos = wait_finished(jobstate.JobStatePoller([job]), timeout=240, poll_s=1)
    assert infos[job].state == "COMPLETED"
    logs = study_dir / "gpus2" / "logs"  # the point's own run directory
    first = (logs / f"sbatch-{job}-restart0.log").read_text()
    assert "requeueing job" in first and "(srun exit 75)" not in first
    assert len(list(logs.glob("requeue-*-restart0"))) == 1
    assert "srun exited with status 0" in (logs / f"sbatch-{job}-restart1.log").read_text()
    assert json.loads((study_dir / "study.json").read_text())["points"][0]["gpus"] == 2
