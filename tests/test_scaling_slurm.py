"""Weak and strong sweeps over 1 and 2 ranks (1 and 2 nodes) of the tiny VOLO on the real local
Slurm."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import one_rank_per_node, profile_copy
from vitpod.workflows.studies.scaling import main

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("localslurm_data")]
REPO = Path(__file__).resolve().parents[1]


def sweep(tmp_path, mode, batch):
    study_dir = tmp_path / f"{mode}-study"
    # One rank a node: the 2-rank point spans both nodes, and the sweep starts 3 ranks, not 7.
    profile = profile_copy(tmp_path, data=REPO / "data", **one_rank_per_node())
    argv = [
        "--cluster", str(profile), "--model", "volo_tiny", "--mode", mode, "--gpus", "1 2",
        "--batch", str(batch), "--steps", "12", "--warmup", "4", "--study-dir", str(study_dir),
        "--args", "--loader torch --workers 0", "--wait", "--timeout", "400",
    ]  # fmt: skip
    assert main(argv) == 0
    table = json.loads((study_dir / "report" / "table.json").read_text())
    html = (study_dir / "report" / "report.html").read_text()
    study = json.loads((study_dir / "study.json").read_text())
    return table["rows"], html, study


def study_dir_of(rows):
    return Path(rows[0]["run_dir"]).parent


def check_common(rows, html, study):
    assert [r["gpus"] for r in rows] == [1, 2]
    assert [r["state"] for r in rows] == ["ok", "ok"], [r["error"] for r in rows]
    assert all(p["job_id"] for p in study["points"])
    assert all(p["state"] in ("COMPLETED", None) for p in study["points"])
    assert len(re.findall(r'src="data:image/png;base64,', html)) == 4
    for row in rows:
        assert row["images_per_s"] > 0
        assert row["efficiency"] == pytest.approx(
            row["images_per_s"] / row["gpus"] / rows[0]["images_per_s"]
        )
        assert row["time"]["step"] > 0
    assert rows[1]["predicted_comm_s"] > 0 and rows[1]["comm_ratio"] > 0
    assert all(r["predicted_step_s"] > 0 and r["step_error"] is not None for r in rows)
    # Each point ran as its own job, sized to it, one after another (afterany on the one
    # before); its CPU-hours (the report job's one sacct) against sacct's own CPUTimeRAW.
    jobs = ",".join(p["job_id"] for p in study["points"])
    fields = "JobID,CPUTimeRAW,NNodes,Timelimit,Start,End"
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", jobs, "-o", fields],
                         capture_output=True, text=True, check=True, timeout=30).stdout  # fmt: skip
    acct = {row[0]: row[1:] for row in (line.split("|") for line in out.split())}
    for point in study["points"]:
        cpu_s, nodes, limit, _, _ = acct[point["job_id"]]
        assert (int(nodes), limit) == (point["nodes"], point["time"]), point
        assert point["device_kind"] == "CPU", point
        assert point["device_hours"] * 3600 == pytest.approx(int(cpu_s), abs=4), point
    first, second = (acct[p["job_id"]] for p in study["points"])
    assert second[3] >= first[4]  # the 2-rank point started once the 1-rank point had ended
    summed = json.loads((Path(study_dir_of(rows)) / "report.json").read_text())
    assert summed["device_hours"] == pytest.approx(sum(p["device_hours"] for p in study["points"]))


def test_weak_sweep_on_local_slurm(local_slurm, tmp_path):
    rows, html, study = sweep(tmp_path, "weak", 8)
    check_common(rows, html, study)
    assert [r["global_batch"] for r in rows] == [8, 16]
    assert "<b>This study.</b> Weak scaling" in html


def test_strong_sweep_on_local_slurm(local_slurm, tmp_path):
    rows, html, study = sweep(tmp_path, "strong", 16)
    check_common(rows, html, study)
    assert [r["global_batch"] for r in rows] == [16, 16]
    assert [p["batch_size"] for p in study["points"]] == [16, 8]
    assert [p["nodes"] for p in study["points"]] == [1, 2]
    assert "<b>This study.</b> Strong scaling" in html


def test_failed_points_are_reported_not_dropped(local_slurm, tmp_path, capsys):
    study_dir = tmp_path / "failing"
    argv = [
        "--cluster", "localslurm", "--model", "volo_tiny", "--mode", "weak", "--gpus", "1 2",
        "--batch", "8", "--study-dir", str(study_dir), "--args=--num-classes 3",
        "--wait", "--timeout", "300",
    ]  # fmt: skip
    assert main(argv) == 1
    assert "did not complete" in capsys.readouterr().err
    study = json.loads((study_dir / "study.json").read_text())
    assert [p["state"] for p in study["points"]] == ["FAILED", "FAILED"]
    rows = json.loads((study_dir / "report" / "table.json").read_text())["rows"]
    assert [(r["gpus"], r["state"]) for r in rows] == [(1, "failed"), (2, "failed")]
    assert "FAILED" in rows[0]["error"]
    assert "FAILED" in (study_dir / "report" / "report.html").read_text()
