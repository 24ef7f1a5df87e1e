"""The real local Slurm: 2 nodes x 2 tasks, rank facts, binding, requeue, sacct COMPLETED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import helpers
from tests.fixtures_slurm import preempted_once_python
from vitpod.node.rankinfo import PREFIX
from vitpod.workflows.planning.masterport import master_port
from vitpod.workflows.site.profile import PROFILE_DIR

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slurm


def submit(tmp_path: Path, *argv: str, make: bool = False) -> tuple[str, Path]:
    """Submit with `make pretrain` or `vitpod submit`; returns (job id, run dir)."""
    runner = helpers.make if make else helpers.vitpod
    job, run_dir = helpers.submitted(
        runner("pretrain" if make else "submit", *argv, runs=tmp_path / "runs", timeout=120)
    )
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["job_ids"] == [job]
    return job, run_dir


def rank_facts(run_dir: Path, job: str, restart: int = 0) -> list[dict]:
    facts = []
    for rank in range(4):
        log = (run_dir / "logs" / f"train-{job}-restart{restart}-rank{rank}.log").read_text()
        line = next(x for x in log.splitlines() if x.startswith(PREFIX))
        bind = next(x for x in log.splitlines() if x.startswith("bind: "))
        facts.append({**json.loads(line[len(PREFIX) :]), "bind": bind})
    return facts


def test_two_nodes_by_two_tasks_report_ranks_and_binding(local_slurm, tmp_path):
    job, run_dir = submit(
        tmp_path, "--cluster", "localslurm", "--model", "volo_tiny", "--entry", "rankinfo"
    )
    assert local_slurm.wait(job) == "COMPLETED"
    facts = rank_facts(run_dir, job)
    assert [f["SLURM_PROCID"] for f in facts] == ["0", "1", "2", "3"]
    assert [f["SLURM_LOCALID"] for f in facts] == ["0", "1", "0", "1"]
    assert [f["SLURM_NODEID"] for f in facts] == ["0", "0", "1", "1"]
    assert [f["SLURMD_NODENAME"] for f in facts] == ["node1", "node1", "node2", "node2"]
    assert {f["MASTER_ADDR"] for f in facts} == {"node1"}
    assert {f["MASTER_PORT"] for f in facts} == {str(master_port(int(job)))}
    assert [f["RANK"] for f in facts] == ["0", "1", "2", "3"] and {
        f["WORLD_SIZE"] for f in facts
    } == {"4"}
    # localslurm pins local rank r to CPU r: the binding step chose it and the kernel applied it.
    assert [f["VITPOD_BIND_CPUS"] for f in facts] == ["0", "1", "0", "1"]
    assert [f["affinity"] for f in facts] == [[0], [1], [0], [1]]
    assert all("numactl=numactl --physcpubind=" in f["bind"] for f in facts)
    sbatch_log = (run_dir / "logs" / f"sbatch-{job}-restart0.log").read_text()
    assert "srun exited with status 0" in sbatch_log


@pytest.mark.slow
def test_make_pretrain_runs_the_trainer_on_two_nodes(local_slurm, localslurm_data, tmp_path):
    args = "ARGS=--max-steps 2 --epochs 1 --workers 0 --loader torch"
    job, run_dir = submit(tmp_path, "CLUSTER=localslurm", "MODEL=volo_tiny", args, make=True)
    assert local_slurm.wait(job, timeout=240) == "COMPLETED"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 2
    assert (run_dir / "final" / "model.pt").is_file()
    assert sorted(p.name for p in (run_dir / "metrics").iterdir()) == [
        f"rank{r}.jsonl" for r in range(4)
    ]
    for rank in range(4):
        log = (run_dir / "logs" / f"train-{job}-restart0-rank{rank}.log").read_text()
        assert log.startswith(f"bind: rank={rank} local_rank={rank % 2} node={rank // 2}")


@pytest.mark.slow
def test_exit_75_requeues_and_the_restart_logs_separately(local_slurm, tmp_path):
    then = f'exec {sys.executable} "$@"'
    wrapper = preempted_once_python(tmp_path / "python-preempted-once", then=then)
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["python"] = str(wrapper)
    profile = tmp_path / "preempted.yaml"
    profile.write_text(yaml.safe_dump(data))
    job, run_dir = submit(
        tmp_path, "--cluster", str(profile), "--model", "volo_tiny", "--entry", "rankinfo"
    )
    assert local_slurm.wait(job, timeout=240) == "COMPLETED"
    first = (run_dir / "logs" / f"sbatch-{job}-restart0.log").read_text()
    assert f"requeueing job {job}" in first and "(srun exit 75)" not in first
    assert sorted(p.name for p in (run_dir / "logs").glob("requeue-*")) == [
        f"requeue-{job}-restart0"
    ]
    facts = rank_facts(run_dir, job, restart=1)
    assert {f["SLURM_RESTART_COUNT"] for f in facts} == {"1"}
    assert (
        "srun exited with status 0" in (run_dir / "logs" / f"sbatch-{job}-restart1.log").read_text()
    )


def test_partition_missing_on_the_cluster_fails_before_sbatch(local_slurm, tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["partitions"]["pretrain"]["name"] = "gpu_a100"
    profile = tmp_path / "wrong-partition.yaml"
    profile.write_text(yaml.safe_dump(data))
    env = {**os.environ, "VITPOD_RUN_ROOT": str(tmp_path / "runs")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitpod.workflows",
            "submit",
            "--cluster",
            str(profile),
            "--model",
            "volo_tiny",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "partitions.pretrain.name='gpu_a100' does not exist on this cluster" in out.stderr
    assert "finetune" in out.stderr and "pretrain" in out.stderr  # lists what sinfo has
    assert "submitted" not in out.stdout and not (tmp_path / "runs").exists()


def test_slurm_up_is_idempotent_and_scripts_are_clean(local_slurm):
    up = REPO / "workflows" / "localslurm" / "up.sh"
    out = subprocess.run(["bash", str(up)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "starting" not in out.stderr  # everything was already running
    assert out.stdout.strip().splitlines()[-1] == f"export SLURM_CONF={local_slurm.conf}"
    assert Path("/etc/slurm/slurm.conf").read_text() == local_slurm.conf.read_text()
    assert oct((local_slurm.state / "etc" / "slurmdbd.conf").stat().st_mode & 0o777) == "0o600"
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%R %D"], capture_output=True, text=True)
    assert sorted(sinfo.stdout.split("\n")[:2]) == ["finetune 2", "pretrain 2"]
    subprocess.run(["shellcheck", "-x", str(up), str(up.with_name("down.sh"))], check=True)


def test_hostile_run_path_survives_real_sbatch_and_srun(local_slurm, tmp_path):
    canary = tmp_path / "CANARY"
    root = tmp_path / f"runs with space $(touch {canary}) `touch {canary}`; touch {canary} 'q'"
    args = f"--x '$(touch {canary})' --y 'a; touch {canary}'"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitpod.workflows",
            "submit",
            "--cluster",
            "localslurm",
            "--entry",
            "rankinfo",
            "--run-root",
            str(root),
            "--args",
            args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    job, run_dir = helpers.submitted(out)
    assert run_dir.parent == root
    assert local_slurm.wait(job) == "COMPLETED"
    assert len(rank_facts(run_dir, job)) == 4  # every rank logged inside the hostile path
    assert (run_dir / "logs" / f"sbatch-{job}.out").exists()  # the quoted #SBATCH --output
    assert not canary.exists()
