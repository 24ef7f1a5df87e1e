"""On the real local Slurm: the study report appears by itself, and FOLLOW views end by themselves.

- `make scaling` and nothing else: the dependent report job (afterany on every point) writes
  report.html, with failed points shown as failed.
- `make scaling FOLLOW=1`: follows the points until the report exists, then prints its path.
- `make status RUN=... FOLLOW=1` on a job that raises: ends and prints the root-cause traceback.
"""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tests.helpers import make, wait_until
from vitpod.workflows.studies import scaling
from vitpod.workflows.watching import follow

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("localslurm_data")]


def study_argv(study_dir: Path, gpus: str, args: str, *extra: str) -> list[str]:
    return [
        "--cluster", "localslurm", "--model", "volo_tiny", "--mode", "weak", "--gpus", gpus,
        "--batch", "8", "--steps", "8", "--warmup", "2", "--study-dir", str(study_dir),
        f"--args={args}", *extra,
    ]  # fmt: skip


def test_report_appears_by_itself_with_failed_points(local_slurm, tmp_path, capsys):
    study_dir = tmp_path / "failing"
    # Every point's trainer finds 10 classes in the data, not 3, and exits 2 (a mismatch only
    # the data reveals; the planner refuses bad flags before submission): both tasks FAILED.
    assert scaling.main(study_argv(study_dir, "1 2", "--num-classes 3")) == 0
    out = capsys.readouterr().out
    # after the preflight: each point's size, and the study's node-hours (no earlier run here:
    # each point keeps the partition's 30 minutes)
    assert "point 2 rank(s): 1 node(s) x 2 task(s), --time=00:30:00" in out
    assert "study: 2 point job(s) run one after another, 1 node-hours at most" in out
    assert "submitted report job" in out and "afterany:" in out
    html = study_dir / "report" / "report.html"
    assert out.strip().splitlines()[-1] == str(html)  # returns at once: no report yet
    study = json.loads((study_dir / "study.json").read_text())
    assert study["report_job_id"] and (study_dir / "report.sbatch").is_file()

    wait_until(f"{html} to appear", html.is_file, 300, interval=0.5)
    assert local_slurm.wait(study["report_job_id"], timeout=120) == "COMPLETED"
    rows = json.loads((study_dir / "report" / "table.json").read_text())["rows"]
    assert [(r["gpus"], r["state"]) for r in rows] == [(1, "failed"), (2, "failed")]
    study = json.loads((study_dir / "study.json").read_text())
    assert [p["state"] for p in study["points"]] == ["FAILED", "FAILED"]
    assert html.read_text().count("FAILED") >= 2

    # `make status RUN=... FOLLOW=1` on the ended study returns by itself (plain lines, no
    # terminal), names the failed points with their first error, and gives the report's path.
    shown = make("status", f"RUN={study_dir}", "FOLLOW=1", timeout=120)
    assert shown.returncode != 0, shown.stdout  # failed points: the command exits 1
    assert "failed points (shown as failed in the report): 1 GPU(s), 2 GPU(s)" in shown.stdout
    assert "10 classes" in shown.stdout
    assert shown.stdout.strip().splitlines()[-1] == f"report: {html}"


def test_scaling_follow_ends_when_the_report_exists(local_slurm, tmp_path, capsys):
    study_dir = tmp_path / "ok"
    argv = study_argv(study_dir, "1 2", "--loader torch --workers 0", "--follow")
    assert scaling.main([*argv, "--interval", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    html = study_dir / "report" / "report.html"
    assert lines[-1] == f"report: {html}" and html.is_file()
    # Plain lines (no terminal under pytest): every point reached its last step, and the
    # report job's row ended COMPLETED.
    assert any("1 GPU(s)" in x and "COMPLETED" in x and "step=8/8" in x for x in lines)
    assert any("2 GPU(s)" in x and "COMPLETED" in x and "step=8/8" in x for x in lines)
    assert any(x.split()[1:3] == ["report", "COMPLETED"] for x in lines)
    rows = json.loads((study_dir / "report" / "table.json").read_text())["rows"]
    assert [r["state"] for r in rows] == ["ok", "ok"]


def test_status_follow_ends_on_failure_with_the_root_cause(local_slurm, tmp_path):
    """A real Slurm job whose rank raises after a peer's communication error: the view ends
    when the job fails and shows the non-communication traceback, live table included."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    script = tmp_path / "rank0.py"
    script.write_text(
        "import time\n"
        "time.sleep(3)\n"
        "def load_shard(): raise ValueError('shard 7 is corrupt')\n"
        "load_shard()\n"
    )
    job = subprocess.run(
        ["sbatch", "--parsable", "--partition=pretrain", "--ntasks=1", "--time=5",
         f"--output={run}/logs/train-%j-restart0-rank0.log", "--wrap",
         shlex.join([sys.executable, str(script)])],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (run / "logs" / f"train-{job}-restart0-rank1.log").write_text(
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234\n"
    )
    (run / "manifest.json").write_text(json.dumps({"stage": "pretrain", "job_ids": [job]}))
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    assert follow.follow(run, interval=1, console=console, timeout=240) == 1
    text = out.getvalue()
    assert "FAILED" in text and "ETA" in text
    assert "pretrain: ended FAILED" in text
    assert "ValueError: shard 7 is corrupt" in text and "Connection closed" not in text
