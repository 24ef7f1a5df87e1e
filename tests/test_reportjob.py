"""The report job's script: after the whole array, small, and launched like the sweep itself."""

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


def test_report_script_waits_for_the_array_and_asks_for_little(tmp_path):
    sweep = sweep_of(tmp_path, "dgxpod", "8 16")
    script = reportjob.render_script(sweep.spec, sweep.study_dir, "4242")
    head = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --dependency=afterany:4242" in head  # the ArrayJobID: every task
    assert {"#SBATCH --nodes=1", "#SBATCH --mem=2G", "#SBATCH --no-requeue"} <= set(head)
    assert not any(x.startswith(("#SBATCH --gpus", "#SBATCH --exclusive")) for x in head)
    assert not any(x.startswith("#SBATCH --signal") for x in head)
    # The same container, mounts and working directory as the sweep's ranks.
    sweep_srun = [line.strip() for line in sweep.script.splitlines() if "--container-" in line]
    report_srun = [line.strip() for line in script.splitlines() if "--container-" in line]
    assert sweep_srun and report_srun == sweep_srun
    assert "-m vitpod.workflows.studies.reportjob" in script and "--array-job 4242" in script


def test_report_script_quotes_a_hostile_study_path(tmp_path):
    sweep = sweep_of(tmp_path, "localslurm", "1 2")
    path = tmp_path / "report.sbatch"
    path.write_text(reportjob.render_script(sweep.spec, sweep.study_dir, "7"))
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout
    # Run for real up to srun: the study path reaches echo intact, nothing is executed.
    body = path.read_text().replace("srun ", "printf '%s\\n' srun ", 1)
    out = subprocess.run(["bash", "-c", body], capture_output=True, text=True, check=True)
    assert str(sweep.study_dir) in out.stdout.splitlines()[-3:]
