"""Hostile paths and ARGS render safely; secrets by name; private run dirs; no torch needed."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from vitpod.registry.decision import read_decision
from vitpod.workflows import cli
from vitpod.workflows.site.profile import PROFILE_DIR

REPO = Path(__file__).resolve().parents[1]


def hostile_args(canary: Path) -> list[str]:
    """Trainer arguments (string-valued flags the trainer's parser accepts) that would create
    `canary` if any shell evaluated them."""
    c = str(canary)
    return [
        "--aa",
        f"$(touch {c})",
        "--token-label-data",
        f"`touch {c}`",
        "--aa",
        f"a; touch {c}",
        "--token-label-data",
        f'it\'s "quoted" && touch {c}',
        "--aa",
        "with  two   spaces",
    ]


def test_a_newline_in_args_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    canary = tmp_path / "CANARY"
    root = tmp_path / "runs"
    status = cli.main(["render", "--cluster", "localslurm", "--model", "volo_tiny",
                       "--args", shlex.join(["--aa", f"line1\ntouch {canary}"]),
                       "--run-root", str(root)])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and "contains a newline" in err and len(err.strip().splitlines()) == 1
    assert not root.exists() and not canary.exists()


def hostile_root(tmp_path: Path, canary: Path) -> Path:
    return tmp_path / f"runs $(touch {canary}) `touch {canary}`; touch {canary} 'q'"


def render_hostile(tmp_path: Path, canary: Path, capsys, cluster: str = "localslurm") -> Path:
    args = shlex.join(hostile_args(canary))
    status = cli.main(
        [
            "render",
            "--cluster",
            cluster,
            "--model",
            "volo_tiny",
            "--args",
            args,
            "--run-root",
            str(hostile_root(tmp_path, canary)),
        ]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    return Path(out.strip().splitlines()[-1])


def shims(tmp_path: Path, srun_status: int = 0) -> Path:
    """Stand-ins for srun and scontrol (the real ones run in test_slurm_cluster.py) that record
    their argv NUL-separated."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "srun": f"printf '%s\\0' \"$@\" > {shlex.quote(str(tmp_path / 'srun.argv'))}\n"
        f"exit {srun_status}",
        "scontrol": textwrap.dedent(f"""\
            if [ "$1" = show ]; then exec seq -f 'node%g' 1 200000; fi
            printf '%s\\0' "$@" > {shlex.quote(str(tmp_path / "scontrol.argv"))}"""),
    }.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def slurm_env(bin_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
    }


def test_header_and_env_part_run_without_evaluating_anything(tmp_path, capsys):
    canary = tmp_path / "CANARY"
    script = render_hostile(tmp_path, canary, capsys)
    text = script.read_text()
    # the #SBATCH header, run dir, logs and environment
    head = text[: text.index("VITPOD_PHASE=ranks\nset +e")]
    probe = head + 'printf "%s|%s|%s" "$RUN_DIR" "$MASTER_ADDR" "$MASTER_PORT" > "$1"\n'
    result = tmp_path / "result"
    out = subprocess.run(
        ["bash", "-c", probe, "probe", str(result)],
        env=slurm_env(shims(tmp_path)),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert not canary.exists()
    assert result.read_text() == f"{script.parent}|node1|{10000 + 4242}"
    sbatch_log = script.parent / "logs" / "sbatch-4242-restart0.log"
    assert "vitpod: job 4242 restart 0" in sbatch_log.read_text()


def test_whole_script_starts_ranks_from_the_plan_holding_args_verbatim_and_requeues_on_75(
    tmp_path, capsys
):
    canary = tmp_path / "CANARY"
    script = render_hostile(tmp_path, canary, capsys)
    bin_dir = shims(tmp_path, srun_status=75)
    out = subprocess.run(
        ["bash", str(script)], env=slurm_env(bin_dir), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    argv = (tmp_path / "srun.argv").read_text().split("\0")[:-1]
    hostile = hostile_args(canary)
    assert argv[argv.index("bash") + 1] == str(script.parent / "bind.sh")
    assert argv[argv.index("--plan") + 1] == str(script.parent / "plan.json")
    assert not set(hostile[1::2]) & set(argv)  # ARGS reach the ranks through plan.json only
    trainer = read_decision(script.parent).trainer
    assert trainer is not None  # the last of each repeated flag wins, every character kept
    sections = {k: v for part in trainer.model_dump().values() for k, v in part.items()}
    assert sections["token_label_data"] == hostile[-3] and sections["aa"] == hostile[-1]
    assert sections["output"] == str(script.parent)
    assert (tmp_path / "scontrol.argv").read_text().split("\0")[:-1] == ["requeue", "4242"]
    assert not canary.exists()


@pytest.mark.parametrize(("rank0_status", "requeued"), [(75, True), (1, False)])
def test_sbatch_requeues_on_a_rank_marker_whatever_srun_reports(
    tmp_path, capsys, rank0_status, requeued
):
    """Rank 0 exits 75 (or 1) through bind.sh; rank 1 dies of SIGTERM as srun --wait ends it, so
    srun reports 143, not 75. Only rank 0's marker can tell the script to requeue."""
    python = tmp_path / "python-rank0-leaves"
    python.write_text(
        f'#!/bin/bash\n[ "$SLURM_PROCID" = 0 ] && exit {rank0_status}\nkill -TERM $$\n'
    )
    python.chmod(0o755)
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump({**data, "python": str(python)}))
    script = render_hostile(tmp_path, tmp_path / "CANARY", capsys, cluster=str(profile))
    bin_dir = shims(tmp_path)
    # srun stand-in: run the step's command (bash bind.sh ...) as local ranks 0 and 1 of one
    # node and exit with the highest status, as srun does.
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        'while [ "$1" != bash ]; do shift; done\n'
        "high=0\n"
        "for r in 0 1; do\n"
        '  SLURM_PROCID=$r SLURM_LOCALID=$r SLURM_NTASKS=2 "$@"; rc=$?\n'
        '  [ "$rc" -gt "$high" ] && high=$rc\n'
        "done\n"
        'exit "$high"\n'
    )
    out = subprocess.run(
        ["bash", str(script)], env=slurm_env(bin_dir), capture_output=True, text=True
    )
    log = (script.parent / "logs" / "sbatch-4242-restart0.log").read_text()
    marker = script.parent / "logs" / "requeue-4242-restart0"
    assert marker.exists() == requeued
    assert (tmp_path / "scontrol.argv").exists() == requeued
    if requeued:
        assert out.returncode == 0, log
        assert (tmp_path / "scontrol.argv").read_text().split("\0")[:-1] == ["requeue", "4242"]
        assert "preempted (srun exit 143); requeueing job 4242" in log
    else:
        assert out.returncode == 143 and "srun exited with status 143" in log
    assert not (tmp_path / "CANARY").exists()


def test_bind_script_execs_the_command_with_args_intact(tmp_path, capsys):
    canary = tmp_path / "CANARY"
    script = render_hostile(tmp_path, canary, capsys)
    env = {
        **os.environ,
        "SLURM_JOB_ID": "4242",
        "SLURM_LOCALID": "1",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "1",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "20001",
    }
    cmd = [
        "bash",
        str(script.parent / "bind.sh"),
        sys.executable,
        "-c",
        "import os, sys, json; print(json.dumps([sys.argv[1:], sorted(os.sched_getaffinity(0)),"
        " os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE']]))",
        *hostile_args(canary),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    bind_line, result = out.stdout.strip().splitlines()
    assert bind_line.startswith("bind: rank=3 local_rank=1 node=1") and "cpus=1" in bind_line
    assert "numactl=numactl --physcpubind=1 --membind=0" in bind_line
    assert json.loads(result) == [hostile_args(canary), [1], "3", "1", "4"]
    assert not canary.exists()


def test_unknown_local_rank_fails_loudly(tmp_path, capsys):
    script = render_hostile(tmp_path, tmp_path / "CANARY", capsys)
    env = {**os.environ, "SLURM_LOCALID": "7", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"}
    out = subprocess.run(
        ["bash", str(script.parent / "bind.sh"), "true"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and "no binding for local rank 7" in out.stderr


def test_secrets_pass_by_name_never_by_value(tmp_path, monkeypatch, capsys):
    data = yaml.safe_load((PROFILE_DIR / "dgxpod.yaml").read_text())
    data["secrets"] = ["MY_SERVICE_TOKEN"]
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("MY_SERVICE_TOKEN", "s3cr3t-value-123")
    status = cli.main(
        [
            "render",
            "--cluster",
            str(profile),
            "--model",
            "volo_d1",
            "--run-root",
            str(tmp_path / "runs"),
        ]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    run_dir = Path(out.strip().splitlines()[-1]).parent
    texts = [p.read_text() for p in run_dir.iterdir() if p.is_file()]
    assert not any("s3cr3t-value-123" in t for t in texts)
    script = (run_dir / "job.sbatch").read_text()
    assert "MY_SERVICE_TOKEN" in script.split("--container-env=")[1].split()[0]


def test_run_dirs_are_private_even_with_a_permissive_umask(tmp_path, capsys):
    old = os.umask(0)
    try:
        status = cli.main(
            [
                "render",
                "--cluster",
                "localslurm",
                "--model",
                "volo_tiny",
                "--run-root",
                str(tmp_path / "runs"),
            ]
        )
    finally:
        os.umask(old)
    out, err = capsys.readouterr()
    assert status == 0, err
    run_dir = Path(out.strip().splitlines()[-1]).parent
    for path in [run_dir.parent, run_dir, *run_dir.rglob("*")]:  # the run root it created too
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & (stat.S_IWOTH | stat.S_IWGRP), f"{path} is writable ({oct(mode)})"
        assert not mode & stat.S_IROTH, f"{path} is world-readable ({oct(mode)})"


def test_quote_or_newline_in_the_run_root_is_refused(tmp_path, capsys):
    for bad in ('runs"x', "runs\nx", "runs%j"):
        status = cli.main(
            [
                "render",
                "--cluster",
                "localslurm",
                "--model",
                "volo_tiny",
                "--run-root",
                str(tmp_path / bad),
            ]
        )
        assert status == 2
        assert "a run path cannot contain" in capsys.readouterr().err
        assert not (tmp_path / bad).exists()


BLOCK_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'torchvision', 'timm', 'deepspeed', 'numpy'):
            raise ImportError('blocked on a login node: ' + name)
sys.meta_path.insert(0, Block())
import vitpod.workflows.cli, vitpod.workflows.errors, vitpod.workflows.site.profile
import vitpod.workflows.planning.recipe, vitpod.workflows.jobs.rundir
import vitpod.workflows.planning.spec
import vitpod.workflows.templating, vitpod.node.rankinfo
import vitpod.workflows.submit.submission
import vitpod.workflows.pipeline.chain, vitpod.workflows.jobs.jobstate
import vitpod.workflows.watching.status
import vitpod.workflows.planning.exchange, vitpod.workflows.studies.scaling
import vitpod.workflows.pipeline.demo
import vitpod.workflows.watching.follow, vitpod.workflows.studies.reportjob
import vitpod.analysis.commcost
assert vitpod.workflows.cli.main(['render', '--cluster', 'dgxpod', '--model', 'volo_d5',
                           '--run-root', sys.argv[1]]) == 0
assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')]
"""


def test_workflows_import_and_render_without_torch(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("job.sbatch")
