"""plan.json: written once by the planner, read back typed; the trainer takes its engine from it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vitpod.registry.decision import (
    RecordError,
    find_decision,
    read_decision,
    write_decision,
)
from vitpod.trainer.decision import DecisionConflict, with_decision
from vitpod.trainer.flags import parse_args
from vitpod.workflows.plan import Request, plan_job

REPO = Path(__file__).resolve().parents[1]


def planned(tmp_path: Path, args: str = "", nodes: int = 2):
    plan = plan_job(
        Request(cluster="localslurm", model="volo_tiny", nodes=nodes, args=args,
                run_root=str(tmp_path / "runs"))
    )  # fmt: skip
    plan.run_dir.mkdir(parents=True)
    write_decision(plan.run_dir, plan.decision)
    return plan


def test_the_record_reads_back_equal_and_typed(tmp_path):
    plan = planned(tmp_path)
    back = read_decision(plan.run_dir)
    assert back == plan.decision
    assert back.resources.world_size == plan.spec.world_size
    assert back.layout.dp * back.layout.tp * back.layout.pp == back.resources.world_size
    assert back.engine.name in ("ring", "ps") and back.costs is not None


def test_a_record_of_another_version_or_shape_names_the_file(tmp_path):
    plan = planned(tmp_path)
    path = plan.run_dir / "plan.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(RecordError, match=r"plan\.json: version 99"):
        read_decision(plan.run_dir)
    path.write_text(json.dumps({**data, "engine": {"name": "star"}}))
    with pytest.raises(RecordError, match=r"plan\.json: engine\.name"):
        read_decision(plan.run_dir)
    assert find_decision(tmp_path) is None  # a run started by hand has none


def test_the_trainer_takes_the_engine_and_servers_from_the_record(tmp_path):
    plan = planned(tmp_path, args="--topology ps")
    assert plan.decision.engine.name == "ps"
    servers = plan.decision.engine.ps_servers
    assert servers == plan.spec.world_size  # the colocated server the cost model priced
    argv = [*plan.spec.command[3:]]
    cfg, decision = with_decision(parse_args(argv, world_size=plan.spec.world_size))
    assert (cfg.topology, cfg.ps_servers) == ("ps", servers) and decision == plan.decision
    # Without --topology in the argv the record still decides (argv is the user's flags).
    bare = [a for a in argv if a not in ("--topology", "ps")]
    cfg, _ = with_decision(parse_args(bare, world_size=plan.spec.world_size))
    assert (cfg.topology, cfg.ps_servers) == ("ps", servers)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--topology", "ring"], "engine 'ring' but the planner decided 'ps'"),
        (["--deepspeed"], "engine 'deepspeed' but the planner decided 'ps'"),
        (["--ps-servers", "1"], "--ps-servers 1 but the planner decided"),
    ],
)
def test_a_flag_that_disagrees_with_the_record_is_refused(tmp_path, flags, words):
    plan = planned(tmp_path, args="--topology ps")
    argv = [a for a in plan.spec.command[3:] if a not in ("--topology", "ps")]
    with pytest.raises(DecisionConflict, match=words):
        with_decision(parse_args([*argv, *flags], world_size=plan.spec.world_size))


def test_a_rank_started_with_a_disagreeing_flag_exits_2_before_training(tmp_path):
    """As a user meets it: the job's own command line plus one flag, run as a rank runs it."""
    plan = planned(tmp_path, args="--topology ps")
    argv = [a for a in plan.spec.command[3:] if a not in ("--topology", "ps")]
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": str(plan.spec.world_size)}
    done = subprocess.run(
        [sys.executable, "-m", "vitpod.trainer", *argv, "--topology", "ring"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "plan.json" in lines[0] and "'ring'" in lines[0], done.stderr
    assert not (plan.run_dir / "metrics").exists()  # refused before any rank trained
