"""A hostile study path, run for real: the scaling report job submitted to the local Slurm.

Issue 30 (finding 9): a study submitted with `--study-dir '.../st$(touch X)u`touch Y`dy'` ran
both commands in its report job. Here the report job of such a study is rendered by the
project's own code, submitted with the real sbatch after a real job, and run by Slurm: it must
end without creating the marker file, its log must show the path byte for byte, and the report
command must have received it as one argument.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import HOSTILE, hostile_profile
from vitpod.workflows.studies import reportjob, scaling

pytestmark = [pytest.mark.slurm]


def test_a_hostile_study_path_runs_nothing_in_a_real_report_job(local_slurm, tmp_path: Path):
    marker = tmp_path / "PWNED"
    env = {"P": str(marker)}  # sbatch exports the submitting environment to the job
    cluster, root = hostile_profile(tmp_path, "localslurm")
    study_dir = root / "runs" / f"st{HOSTILE}dy"
    ns = scaling.build_parser().parse_args(
        ["--cluster", str(cluster), "--gpus", "1", "--study-dir", str(study_dir),
         "--steps", "2", "--warmup", "1"]
    )  # fmt: skip
    sweep = scaling.prepare(ns)
    study_dir.mkdir(parents=True)
    Path(sweep.report_spec.log_dir).mkdir(parents=True, exist_ok=True)
    wrap = ["sbatch", "--parsable", "--partition=pretrain", "--output=/dev/null", "--wrap", "true"]
    first = subprocess.run(wrap, capture_output=True, text=True, check=True).stdout.strip()
    script = study_dir / "report.sbatch"
    script.write_text(reportjob.render_script(sweep.report_spec, study_dir, [first]))
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)  # fmt: skip
    job = out.stdout.strip().split(";")[0]
    local_slurm.wait(job, timeout=300)
    assert not marker.exists(), "a payload in the study path ran inside the real report job"
    log = (Path(sweep.report_spec.log_dir) / f"report-{job}.out").read_text()
    assert f"vitpod: report of {study_dir} after point jobs {first}" in log, log
