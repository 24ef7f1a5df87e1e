"""A node-range job (`nodes: 1-2`) on the real local Slurm: with node2 drained Slurm starts it
on one node, otherwise on two; both keep the planned global batch and read the same samples."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.fixtures_slurm import queue_state, submit, wait_usable
from tests.helpers import profile_copy, step_records, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ARGS = ("-b 8 --workers 0 --loader torch --epochs 1 --max-steps 6 --log-interval 1"
        " --checkpoint-every 0 --log-sample-ids --no-eval")  # fmt: skip


def test_a_node_range_job_runs_on_what_slurm_gives_with_the_same_samples(
    local_slurm, digits_dir: Path, tmp_path: Path
) -> None:
    profile = profile_copy(tmp_path, data=digits_dir.parent, nodes="1-2")
    drain = ["scontrol", "update", "nodename=node2", "state=drain", "reason=vitpod-test"]
    try:
        subprocess.run(drain, check=True, timeout=30)
        one, one_run = submit(tmp_path, profile, ARGS)
        wait_until(f"job {one} to start", lambda: queue_state(one) != "PENDING", timeout=300)
    finally:
        subprocess.run(["scontrol", "update", "nodename=node2", "state=resume"], timeout=30)
        wait_usable("node2")
    two, two_run = submit(tmp_path, profile, ARGS)
    assert local_slurm.wait(one, timeout=900) == "COMPLETED"
    assert local_slurm.wait(two, timeout=900) == "COMPLETED"
    a, b = step_records(one_run), step_records(two_run)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert {r["world_size"] for r in a.values()} == {2}  # 1 node x 2 ranks
    assert {r["world_size"] for r in b.values()} == {4}  # 2 nodes x 2 ranks
    assert [a[s]["sample_digest"] for s in a] == [b[s]["sample_digest"] for s in a]
    configs = [json.loads((r / "config.json").read_text()) for r in (one_run, two_run)]
    assert [c["accum_steps"] for c in configs] == [2, 1]
    assert configs[0]["global_batch"] == configs[1]["global_batch"] == 32
