"""The report job's script: after every point's job, small, and launched like the points."""

from __future__ import annotations

import shutil
import subprocess

from vitpod.workflows.studies import reportjob, scaling


def sweep_of(tmp_path, cluster: str, gpus: str) -> scaling.Sweep:
    ns = scaling.build_parser().parse_args(
        ["--cluster", cluster, "--gpus", gpus, "--study-dir", str(tmp_path / "st'udy; echo x")]
    )
    ns.model = "volo_tiny" if cluster == "localslurm" else "volo_d5"
    return scaling.prepare(ns)


def test_report_script_waits_for_every_point_and_asks_for_little(tmp_path):
    sweep = sweep_of(tmp_path, "dgxpod", "8 16")
    script = reportjob.render_script(sweep.report_spec, sweep.study_dir, ["4242", "4243"])
    head = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --dependency=afterany:4242:4243" in head  # every point, however it ended
    assert {"#SBATCH --nodes=1", "#SBATCH --mem=2G", "#SBATCH --no-requeue"} <= set(head)
    assert not any(x.startswith(("#SBATCH --gpus", "#SBATCH --exclusive")) for x in head)
    assert not any(x.startswith("#SBATCH --signal") for x in head)
    # its log in the study's logs/, not a point's
    assert any(x.startswith("#SBATCH --output=") and "udy; echo x/logs/report-%j.out" in x
               for x in head)  # fmt: skip
    # The same container, mounts and working directory as the points' ranks.
    point = sweep.plans[0].script
    point_srun = [line.strip() for line in point.splitlines() if "--container-" in line]
    report_srun = [line.strip() for line in script.splitlines() if "--container-" in line]
    assert point_srun and report_srun == point_srun
    assert "-m vitpod.workflows.studies.reportjob" in script and "--array-job" not in script


def test_report_script_quotes_a_hostile_study_path(tmp_path):
    sweep = sweep_of(tmp_path, "localslurm", "1 2")
    path = tmp_path / "report.sbatch"
    path.write_text(reportjob.render_script(sweep.report_spec, sweep.study_dir, ["7", "8"]))
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout
    # Run for real up to srun: the study path reaches echo intact, nothing is executed.
    body = path.read_text().replace("srun ", "printf '%s\\n' srun ", 1)
    out = subprocess.run(["bash", "-c", body], capture_output=True, text=True, check=True)
    assert str(sweep.study_dir) in out.stdout.splitlines()[-3:]
