"""`vitpod resume`: a run re-planned for another node count keeps its global batch, picks the
accumulation, names the node counts that work when the batch cannot split, and keeps the
previous plan as plan.restart<N>.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import one_rank_per_node, profile_copy
from vitpod.registry import runfiles
from vitpod.workflows import cli
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.submit.resume import archive, plan_resume
from vitpod.workflows.submit.submission import materialize


def _render(tmp_path: Path, args: str, nodes: int = 2, cluster: str = "localslurm") -> Path:
    argv = ["render", "--cluster", cluster, "--model", "volo_tiny", "--nodes", str(nodes),
            f"--args={args}", "--run-root", str(tmp_path / "runs")]  # fmt: skip
    assert cli.main(argv) == 0
    return next((tmp_path / "runs").iterdir())


def test_resume_on_fewer_nodes_keeps_the_global_batch_and_the_old_plan(tmp_path: Path) -> None:
    run = _render(tmp_path, "-b 8 --epochs 1 --warmup-epochs 0")  # 2 nodes x 2 ranks x 8 = 32
    before = json.loads((run / runfiles.PLAN).read_text())
    plan = plan_resume(run, "1")
    assert plan.trainer is not None and plan.decision is not None
    assert (plan.trainer["accum_steps"], plan.trainer["global_batch_size"]) == (2, 32)
    assert plan.decision.resources.nodes == 1 and plan.decision.layout.dp == 2
    assert archive(run, plan.script_name) == 1
    materialize(plan, plan.manifest(restart=1), existing=True)  # as resume writes it
    assert json.loads((run / "plan.restart1.json").read_text()) == before
    assert "#SBATCH --nodes=2" in (run / "job.restart1.sbatch").read_text()
    assert "#SBATCH --nodes=1" in (run / runfiles.SBATCH).read_text()
    assert json.loads((run / runfiles.MANIFEST).read_text())["restart"] == 1
    assert json.loads((run / runfiles.PLAN).read_text())["resources"]["world_size"] == 2
    assert archive(run, plan.script_name) == 2  # each restart keeps its own


def test_a_global_batch_that_cannot_split_names_the_node_counts_that_work(tmp_path: Path) -> None:
    run = _render(tmp_path, "-b 8 --accum-steps 3 --epochs 1 --warmup-epochs 0", nodes=1)
    # 1 node x 2 ranks x 8 x 3 = 48: 2 nodes (4 ranks) would need accumulation 1.5
    with pytest.raises(ConfigError, match="NODES that work: 1$"):
        plan_resume(run, "2")


def test_a_run_planned_from_a_profile_file_resumes_with_that_file(tmp_path: Path) -> None:
    """CLUSTER=FILE named `localslurm` but with one rank a node: resume re-plans with the file,
    not the bundled profile of that name (4 ranks, whose global batch would not split)."""
    profile = profile_copy(tmp_path, **one_rank_per_node())
    run = _render(tmp_path, "-b 16 --epochs 1 --warmup-epochs 0", cluster=str(profile))
    plan = plan_resume(run, "2")
    assert plan.decision is not None and plan.decision.resources.world_size == 2
    profile.unlink()  # gone: the name is all that is left
    with pytest.raises(ConfigError, match="NODES that work"):
        plan_resume(run, "2")


def test_status_shows_the_ranks_of_each_stretch(tmp_path: Path) -> None:
    from vitpod.workflows.jobs.jobstate import JobState
    from vitpod.workflows.watching.runsizes import world_sizes
    from vitpod.workflows.watching.status import stage_status, status_line

    (tmp_path / "metrics").mkdir()
    steps = [(1, 4), (2, 4), (3, 2), (2, 2), (4, 4)]  # resized, a step redone, resized back
    lines = [json.dumps({"kind": "step", "step": s, "world_size": w}) for s, w in steps]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("\n".join(lines) + "\n{trunc")
    assert world_sizes(tmp_path) == [4, 2, 4]
    line = status_line(stage_status(JobState("pretrain", tmp_path, recorded="COMPLETED"), []))
    assert "ranks=4>2>4" in line
