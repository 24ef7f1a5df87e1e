"""Rendering jobs: `make render` output, shellcheck on every profile/recipe, bad input -> exit 2."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import make
from vitpod.registry.decision import read_decision
from vitpod.workflows import cli
from vitpod.workflows.planning.recipe import load_recipe
from vitpod.workflows.planning.spec import build_spec, launch_for
from vitpod.workflows.site.profile import PROFILE_DIR, bundled_profiles, load_profile
from vitpod.workflows.templating import render as render_template

REPO = Path(__file__).resolve().parents[1]


def render(tmp_path: Path, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Path, str]:
    """Run `python -m vitpod.workflows render` in-process; returns (status, script path, stderr)."""
    status = cli.main(["render", "--run-root", str(tmp_path / "runs"), *argv])
    out, err = capsys.readouterr()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return status, Path(last), err


def shellcheck(*paths: Path) -> None:
    out = subprocess.run(
        ["shellcheck", "-s", "bash", *map(str, paths)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-4000:]


def test_make_render_dgxpod_volo_d5(tmp_path):
    out = make("render", "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5", runs=tmp_path / "runs")
    assert out.returncode == 0, out.stderr
    script = Path(out.stdout.strip().splitlines()[-1])
    text = script.read_text()
    assert script.parent.parent == tmp_path / "runs" and script.name == "job.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck(script, script.parent / "bind.sh")
    for line in (
        "--nodes=5",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--partition=dgxa100",
        "--signal=USR2@180",
        "--requeue",
        "--exclusive",
        "--cpus-per-task=32",
    ):
        assert f"#SBATCH {line}\n" in text
    for flag in (
        "--container-image=/lustre/fsw/vitpod/images/vitpod.sqsh",
        "--no-container-mount-home",
        "--container-workdir=",
        "--kill-on-bad-exit=0",
        "--container-mounts=/lustre/fsw/datasets:/lustre/fsw/datasets:ro,",
    ):
        assert flag in text
    assert "--mpi=" not in text  # dgxpod has no `mpi:`: the trainer needs no MPI
    env_flag = re.search(r"--container-env=(\S+) ", text)
    assert env_flag and {"NCCL_SOCKET_IFNAME", "MASTER_ADDR", "WANDB_API_KEY"} <= set(
        env_flag[1].split(",")
    )
    assert (
        f"bash {script.parent}/bind.sh python -m vitpod.trainer \\\n"
        f"  --plan {script.parent}/plan.json\n" in text
    )
    trainer = read_decision(script.parent).trainer
    assert trainer.data["data_dir"] == "/lustre/fsw/datasets/imagenet"
    assert (trainer.data["token_label_size"], trainer.optim["batch_size"]) == (14, 44)
    assert '"token_label_size": 14' in text and '"batch_size": 44' in text  # echoed to the log
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "-eq 75 ]" in text
    bind = (script.parent / "bind.sh").read_text()
    assert "4) numa=7 cpus=112-127,240-255 hca=mlx5_6:1 threads=12 ;;" in bind
    assert "--physcpubind=$cpus" in bind and 'NCCL_IB_HCA="=$hca"' in bind

    manifest = json.loads((script.parent / "manifest.json").read_text())
    assert manifest["profile"]["name"] == "dgxpod" and manifest["recipe"]["model"] == "volo_d5"
    assert manifest["resolved"]["world_size"] == 40 and manifest["job_ids"] == []
    assert manifest["overrides"]["nodes"] == "5"
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["git"]["commit"] or "")
    assert manifest["image"]["image"] == "/lustre/fsw/vitpod/images/vitpod.sqsh"
    assert manifest["recipe"]["values"]["sources"]["drop_path"]
    for path in (script.parent, script.parent / "logs"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o750


def test_every_bundled_profile_and_recipe_renders_shellcheck_clean(tmp_path, capsys):
    pretrained = tmp_path / "pretrained"
    (pretrained / "final").mkdir(parents=True)
    (pretrained / "final" / "model.pt").write_bytes(b"weights")
    scripts: list[Path] = []
    for profile in bundled_profiles():
        for model in ("volo_d1", "volo_d5", "vit_base_patch16_224", "volo_tiny"):
            for stage in ("pretrain", "finetune"):
                status, script, err = render(
                    tmp_path,
                    "--cluster",
                    profile,
                    "--model",
                    model,
                    "--stage",
                    stage,
                    "--finetune-from",
                    str(pretrained) if stage == "finetune" else "",
                    capsys=capsys,
                )
                assert status == 0, err
                scripts.append(script)
                if (script.parent / "bind.sh").exists():
                    scripts.append(script.parent / "bind.sh")
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck(*scripts)


def test_local_profile_renders_a_torchrun_script(tmp_path, capsys):
    status, script, err = render(
        tmp_path,
        "--cluster",
        "local",
        "--model",
        "volo_tiny",
        "--args",
        "--max-steps 3",
        capsys=capsys,
    )
    assert status == 0, err
    text = script.read_text()
    assert script.name == "job.sh" and "#SBATCH" not in text
    assert (
        f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone --nproc-per-node=2"
        in text
    )
    assert text.rstrip().endswith(f"--plan {script.parent}/plan.json")
    record = read_decision(script.parent)
    assert record.engine.name == "ring" and record.trainer.parallel["exchange"] == "ring"
    assert (record.trainer.data["dataset"], record.trainer.optim["max_steps"]) == ("digits", 3)


def test_launch_plan_is_the_one_source_of_the_script(tmp_path):
    profile, recipe = load_profile("dgxpod"), load_recipe("volo_d1")
    spec = build_spec(profile, recipe, "pretrain", run_dir=tmp_path / "run", nodes=2)
    plan = launch_for(spec)
    assert all(isinstance(a, str) and a.startswith("--") for a in plan.srun_args)
    assert list(plan.launcher) == ["bash", str(tmp_path / "run" / "bind.sh"), "python"]
    assert plan.argv[: len(plan.launcher)] == plan.launcher
    assert any(
        line.startswith("MASTER_ADDR=$(scontrol show hostnames") for line in plan.setup_lines
    )
    assert "export NCCL_DEBUG=WARN" in plan.setup_lines
    text = render_template("sbatch.sh.j2", {"spec": spec, "launch": plan, "configuration": []})
    for line in plan.setup_lines:
        assert line in text.splitlines()
    for arg in plan.srun_args:
        assert f"  {shlex.quote(arg)} \\" in text.splitlines()
    assert plan.write_bind_script().read_text() == plan.bind_script
    slurm = launch_for(
        build_spec(load_profile("localslurm"), recipe, "pretrain", run_dir=tmp_path, nodes=2)
    )
    assert f"--chdir={REPO}" in slurm.srun_args and "--mpi=pmi2" in slurm.srun_args
    assert not any(a.startswith("--container") for a in slurm.srun_args)


def test_submit_without_sbatch_says_how_to_render(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    status = cli.main(
        [
            "submit",
            "--cluster",
            "dgxpod",
            "--model",
            "volo_d5",
            "--run-root",
            str(tmp_path / "runs"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "sbatch is not on PATH" in err and "make render CLUSTER=dgxpod MODEL=volo_d5" in err
    assert not (tmp_path / "runs").exists()


def _bad_profile(tmp_path: Path) -> str:
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["partitions"]["pretrain"]["tme"] = "01:00:00"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nodes", "five"], r"NODES='five' is not a whole number"),
        (["--nodes", "0"], r"NODES=0: must be at least 1"),
        (["--args", "--epochs '10"], r"ARGS=.*No closing quotation; balance the quotes"),
        (["--args", "--output /tmp/elsewhere"], r"ARGS: --output is set by vitpod"),
        (["--args", "--plan /tmp/x/plan.json"], r"ARGS: --plan is set by vitpod .*plan\.json"),
        (["--args", "--img-size 256"], r"--token-label-size=14 must be img_size/16 = 16"),
        (["--stage", "finetune"], r"FINETUNE_FROM: the finetune stage needs the pretrain run"),
        (["--model", "volo_d7"], r"MODEL='volo_d7': no recipe; did you mean MODEL=volo_d\d"),
        (["--dependency", "afterok:1\n#SBATCH --x"], r"is not a Slurm dependency; write e\.g\."),
        (
            ["--cluster", "TYPO"],
            r"partitions\.pretrain: unknown key\(s\) 'tme' \(did you mean 'time'\?\)",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_field_and_leaves_no_run_dir(tmp_path, capsys, argv, expected):
    argv = [_bad_profile(tmp_path) if a == "TYPO" else a for a in argv]
    base = ["--cluster", "dgxpod", "--model", "volo_d5"]
    status, _, err = render(tmp_path, *base, *argv, capsys=capsys)
    assert status == 2
    assert re.search(expected, err), err
    assert err.count("\n") == 1  # one clear line
    assert not (tmp_path / "runs").exists()


def test_unknown_command_and_lazy_dispatch(capsys):
    assert cli.main(["nosuch"]) == 2
    known = "commands: render, place, preflight, submit, pipeline, demo, status, scaling"
    assert known in capsys.readouterr().err
    assert set(cli.COMMANDS) == {
        "render", "place", "preflight", "submit", "pipeline", "demo", "status", "scaling",
        "calibrate", "token-labels", "memory", "layouts", "profile", "doctor", "resume", "list",
        "cancel", "clean", "completion",
    }  # fmt: skip
    assert cli._load("render") is cli.render_main


def test_empty_model_falls_back_to_the_profile_default(tmp_path, capsys):
    status, script, err = render(tmp_path, "--cluster", "localslurm", "--model", "", capsys=capsys)
    assert status == 0, err
    assert read_decision(script.parent).trainer.model["model"] == "volo_tiny"
    assert "volo_tiny-pretrain" in script.parent.name
    status, script, err = render(tmp_path, "--cluster", "dgxpod", "--model", "", capsys=capsys)
    assert status == 0 and read_decision(script.parent).trainer.model["model"] == "volo_d5"


@pytest.mark.parametrize("name", ["local", "localslurm"])
def test_submit_refuses_a_missing_shared_path_before_writing(tmp_path, capsys, name):
    if name == "localslurm" and not shutil.which("sbatch"):
        pytest.skip("needs sbatch on PATH (the Slurm client) to get past the login-node check")
    data = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    data["storage"] = {"data": str(tmp_path / "no-data"), "code": str(tmp_path / "no-code")}
    profile = tmp_path / f"{name}.yaml"
    profile.write_text(yaml.safe_dump(data))
    argv = ["--cluster", str(profile), "--model", "volo_d1", "--run-root", str(tmp_path / "runs")]
    assert cli.main(["submit", *argv]) == 2
    err = capsys.readouterr().err
    assert f"profile {name}: storage.data path '{tmp_path}/no-data' does not exist" in err
    assert not (tmp_path / "runs").exists()
    (tmp_path / "no-data").mkdir(parents=True)
    assert cli.main(["submit", *argv]) == 2
    assert f"storage.code path '{tmp_path}/no-code' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # `make render` writes the job for any cluster without touching its shared storage.
    assert cli.main(["render", *argv]) == 0 and (tmp_path / "runs").is_dir()


def test_a_generated_data_set_need_not_exist_before_submit(tmp_path):
    """digits (the demo set) is written by the trainer on first use, so a fresh checkout works."""
    profile, recipe = load_profile("localslurm"), load_recipe("volo_tiny")
    spec = build_spec(profile, recipe, "pretrain", run_dir=tmp_path / "run", nodes=1)
    assert spec.data_dir is None and "digits" in spec.command[3]
    folder = build_spec(
        profile, load_recipe("volo_d1"), "pretrain", run_dir=tmp_path / "run", nodes=1
    )
    assert folder.data_dir == folder.command[3]
