"""Placement on the real local Slurm: a job that may take 1-2 nodes goes on 1 node while node2 is
held by a long job (waiting for 2 would finish later), and on 2 once both are free; the second,
placed by a step time measured in the first, runs, and `make status` puts its predicted start,
run time and finish against sacct's (the error is printed; docs/workflows.md#placement)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.fixtures_slurm import queue_state
from tests.helpers import make, profile_copy, wait_until
from vitpod.registry.decision import read_decision

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ARGS = ("-b 8 --workers 0 --loader torch --epochs 1 --max-steps 20 --log-interval 1"
        " --checkpoint-every 0 --no-eval")  # fmt: skip


def _make(tmp_path: Path, target: str, profile: Path, *extra: str) -> str:
    out = make(target, f"CLUSTER={profile}", "MODEL=volo_tiny", f"ARGS={ARGS}", *extra,
               runs=tmp_path / "runs")  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_ranged_job_is_placed_on_one_node_beside_a_busy_node_and_on_two_when_free(
    local_slurm, digits_dir: Path, tmp_path: Path
) -> None:
    profile = profile_copy(tmp_path, data=digits_dir.parent, nodes="1-2")
    hold = ["sbatch", "--parsable", "-p", "pretrain", "-w", "node2", "--exclusive", "-t", "10",
            "-o", "/dev/null", "--wrap", "sleep 600"]  # fmt: skip
    blocker = subprocess.run(hold, capture_output=True, text=True, check=True).stdout.strip()
    try:
        wait_until("node2 held", lambda: queue_state(blocker) == "RUNNING", timeout=120)
        out = _make(tmp_path, "place", profile)
        script = Path(out.strip().splitlines()[-1])
        first = read_decision(script.parent).placement
        assert first is not None and [c.nodes for c in first.candidates] == [1, 2]
        assert first.prediction.nodes == 1 and "#SBATCH --nodes=1\n" in script.read_text()
        assert first.candidates[1].start > first.candidates[0].start  # 2 wait for node2
        job = subprocess.run(["sbatch", "--parsable", str(script)], cwd=script.parent,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        assert local_slurm.wait(job, timeout=600) == "COMPLETED"
    finally:
        subprocess.run(["scancel", blocker], timeout=30)
    wait_until("node2 free", lambda: queue_state(blocker) == "", timeout=120)
    out = _make(tmp_path, "pretrain", profile, "PLACE=1")
    second = Path(out.strip().splitlines()[-1]).parent
    placed = read_decision(second).placement
    assert placed is not None and placed.prediction.nodes == 2, out
    assert "compute scaled to 1 micro-batch(es)" in placed.prediction.step_time_source
    job = re.search(r"submitted batch job (\d+)", out)[1]
    assert local_slurm.wait(job, timeout=600) == "COMPLETED"
    status = make("status", f"RUN={second}", runs=tmp_path / "runs", timeout=120).stdout
    line = next(ln.strip() for ln in status.splitlines() if "placement (" in ln)
    assert "placement (2 node(s) on pretrain)" in line and "(error " in line, status
    print(f"\nprediction against sacct: {line}")
