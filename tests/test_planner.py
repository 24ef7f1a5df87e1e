"""The one planner and its preflight, driven the way users meet them: make variables and ARGS."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import make
from vitpod.registry.decision import read_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.pipeline.chain import Chain
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.site.profile import PROFILE_DIR

REPO = Path(__file__).resolve().parents[1]


def _make_in(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`make ARGV` as a user types it, with run directories under tmp_path."""
    return make(*argv, runs=tmp_path / "runs")


def run_dirs(tmp_path: Path) -> list[Path]:
    root = tmp_path / "runs"
    return sorted(root.iterdir()) if root.is_dir() else []


def test_misspelt_flag_in_args_is_refused_before_anything_is_written(tmp_path):
    done = _make_in(tmp_path, "render", "CLUSTER=dgxpod", "ARGS=--exchangee ps")
    assert done.returncode == 2, done.stdout
    ours = [line for line in done.stderr.splitlines() if not line.startswith("make:")]
    assert len(ours) == 1 and "--exchangee" in ours[0]  # one clear line
    assert run_dirs(tmp_path) == []
    for args, word in (("--exchange foo", "'foo'"), ("--epochs -3", "--epochs must be at least 1")):
        done = _make_in(tmp_path, "render", "CLUSTER=localslurm", f"ARGS={args}")
        assert done.returncode == 2 and word in done.stderr and "Traceback" not in done.stderr
    assert run_dirs(tmp_path) == []


def test_render_records_the_decision_once_in_plan_json(tmp_path):
    done = _make_in(tmp_path, "render", "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5")
    assert done.returncode == 0, done.stderr
    script = Path(done.stdout.splitlines()[-1])
    decision = read_decision(script.parent)
    assert decision.engine.name in ("ring", "ps") and decision.resources.world_size == 40
    assert decision.engine.source == "cost model" and decision.costs.predicted_comm_s > 0
    assert decision.costs.priced_by == "profile fabric"
    assert decision.layout.dp == 40 and (decision.layout.tp, decision.layout.pp) == (1, 1)
    assert decision.memory["checked"] and decision.memory["gpu"] == "A100-SXM4-80GB"
    assert decision.data.data_dir == "/lustre/fsw/datasets/imagenet"
    # The user's argv keeps --exchange auto; the ranks start from plan.json, which holds the
    # engine the cost model chose in its trainer settings, and the manifest points at it.
    manifest = json.loads((script.parent / "manifest.json").read_text())
    assert "--exchange" not in manifest["resolved"]["command"]
    assert decision.trainer.parallel["exchange"] == decision.engine.name
    assert "trainer" not in manifest and manifest["decision"] == "plan.json"
    assert manifest["stage"] == "pretrain" and manifest["model"] == "volo_d5"


def test_finetune_renders_on_its_own_partition_and_node_type(tmp_path):
    source = "FINETUNE_FROM=/lustre/fsw/vitpod/runs/x"  # exists only on the cluster: OFFLINE=1
    pre = _make_in(tmp_path, "render", "CLUSTER=dgxpod", "MODEL=volo_d5")
    fin = _make_in(tmp_path, "render", "CLUSTER=dgxpod", "MODEL=volo_d5", "STAGE=finetune", source,
               "OFFLINE=1")  # fmt: skip
    assert pre.returncode == 0 and fin.returncode == 0, fin.stderr
    pre_text = Path(pre.stdout.splitlines()[-1]).read_text()
    fin_script = Path(fin.stdout.splitlines()[-1])
    fin_text = fin_script.read_text()
    assert "#SBATCH --partition=dgxa100" in pre_text and "#SBATCH --ntasks-per-node=8" in pre_text
    assert "#SBATCH --partition=dgx2" in fin_text and "#SBATCH --ntasks-per-node=16" in fin_text
    # bind.sh follows the DGX-2 map: 16 local ranks, GPUs 8-15 on socket 1's NUMA node.
    bind = (fin_script.parent / "bind.sh").read_text()
    assert "15)" in bind and "mlx5_9:1" in bind and "24-47,72-95" in bind
    assert read_decision(fin_script.parent).trainer.model["finetune"] == "/lustre/fsw/vitpod/runs/x"
    assert '"finetune": "/lustre/fsw/vitpod/runs/x"' in fin_text  # printed into the log


def test_a_batch_that_cannot_fit_in_gpu_memory_is_refused(tmp_path):
    base = ["CLUSTER=dgxpod", "MODEL=volo_d5", "STAGE=finetune", "FINETUNE_FROM=/lustre/x",
            "OFFLINE=1"]  # fmt: skip
    done = _make_in(tmp_path, "render", *base, "ARGS=-b 64")
    assert done.returncode == 2
    assert "-b 64: the batch does not fit in GPU memory" in done.stderr
    assert "V100-SXM3-32GB" in done.stderr and "use -b 12" in done.stderr
    assert run_dirs(tmp_path) == []
    assert _make_in(tmp_path, "render", *base, "ARGS=-b 4").returncode == 0


def test_more_nodes_than_the_partition_has_is_refused_without_slurm(tmp_path):
    done = _make_in(tmp_path, "render", "CLUSTER=localslurm", "NODES=3")
    assert done.returncode == 2 and "NODES=3" in done.stderr and "NODES=2 or fewer" in done.stderr
    assert run_dirs(tmp_path) == []


def _profile_copy(tmp_path: Path, **partition: object) -> str:
    """localslurm with every partition's fields changed."""
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    for stage in data["partitions"]:
        data["partitions"][stage].update(partition)
    path = tmp_path / f"copy-{len(list(tmp_path.glob('copy-*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.slurm
def test_slurm_refuses_what_the_profile_allows(local_slurm, tmp_path):
    """The profile claims 5 nodes; Slurm's partition has 2: refused before sbatch."""
    cluster = _profile_copy(tmp_path, max_nodes=5)
    done = _make_in(tmp_path, "pretrain", f"CLUSTER={cluster}", "NODES=3")
    assert done.returncode == 2, done.stdout
    assert "NODES=3: partition 'pretrain' can give a job at most 2 node(s)" in done.stderr
    assert run_dirs(tmp_path) == []
    for change, words in (
        ({"name": "nosuch"}, "partitions.pretrain.name='nosuch' does not exist"),
        ({"time": "2-00:00:00"}, None),  # the local partitions have no MaxTime: accepted
    ):
        cluster = _profile_copy(tmp_path, **change)
        done = _make_in(tmp_path, "preflight", f"CLUSTER={cluster}")
        if words is None:
            assert done.returncode == 0, done.stderr
            assert "preflight passed" in done.stdout.splitlines()[-1]
        else:
            assert done.returncode == 2 and words in done.stderr
    assert run_dirs(tmp_path) == []


@pytest.mark.slurm
def test_gpus_the_partition_lacks_are_refused(local_slurm, tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["gpus_per_node"] = 4  # the local nodes have gres gpu:2
    data["tasks_per_node"] = 2
    path = tmp_path / "gpus.yaml"
    path.write_text(yaml.safe_dump(data))
    done = _make_in(tmp_path, "preflight", f"CLUSTER={path}")
    assert (
        done.returncode == 2
        and "needs 4 gres gpu but partition 'pretrain' offers at most 2" in done.stderr
    )


def test_preflight_checks_the_paths_the_ranks_will_read(tmp_path, capsys):
    from vitpod.workflows import cli

    argv = ["--cluster", "local", "--stage", "finetune", "--finetune-from", "/no/such/run"]
    assert cli.main(["preflight", *argv, "--run-root", str(tmp_path / "runs")]) == 2
    assert "FINETUNE_FROM='/no/such/run' does not exist" in capsys.readouterr().err
    empty = tmp_path / "pretrain-run"
    empty.mkdir()
    argv[-1] = str(empty)
    assert cli.main(["preflight", *argv]) == 2
    assert "has no model (final/model.pt, checkpoints/ or a timm folder" in capsys.readouterr().err
    # render refuses it too (before writing), unless it renders for another machine (OFFLINE=1)
    assert cli.main(["render", *argv, "--run-root", str(tmp_path / "runs")]) == 2
    assert "has no model" in capsys.readouterr().err and not (tmp_path / "runs").exists()
    assert cli.main(["render", *argv, "--run-root", str(tmp_path / "runs"), "--offline"]) == 0
    labels = ["--args", "--token-label --token-label-size 2 --token-label-data /no/labels"]
    assert cli.main(["preflight", "--cluster", "local", "--model", "volo_tiny", *labels]) == 2
    assert "token-label data '/no/labels' does not exist" in capsys.readouterr().err


def test_scaling_with_bad_input_exits_2_without_a_traceback(tmp_path):
    for extra in ("ARGS=--warmup x", "ARGS=--exchange foo"):
        done = _make_in(tmp_path, "scaling", "CLUSTER=localslurm", "GPUS=1 2", extra)
        assert done.returncode == 2, done.stdout
        assert "Traceback" not in done.stderr and "error:" in done.stderr


def test_empty_model_names_the_pipeline_after_the_profile_default(tmp_path):
    run = Chain("localslurm", "", run_root=str(tmp_path / "runs"))
    if shutil.which("sbatch") is None:
        pytest.skip("the pipeline's preflight needs sbatch on PATH")
    run.plan()
    assert run.directory is not None and "-volo_tiny-pipeline-" in run.directory.name


def test_status_reads_the_manifest_a_submission_writes(tmp_path):
    from vitpod.workflows.watching.status import stages_of

    plan = plan_job(Request(cluster="localslurm", run_root=str(tmp_path / "runs")))
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "manifest.json").write_text(json.dumps(plan.manifest(["4242"])))
    [stage] = stages_of(plan.run_dir)
    assert (stage.name, stage.run_dir, stage.job_ids) == ("pretrain", plan.run_dir, ["4242"])


def test_planner_imports_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['timm'] = None\n"
        "from vitpod.workflows.planning.plan import Request, plan_job\n"
        "p = plan_job(Request(cluster='dgxpod', model='volo_d5', run_root='/tmp/x'))\n"
        "print(p.decision.engine.name, p.memory['checked'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[1] == "True"


def test_request_errors_are_config_errors():
    with pytest.raises(ConfigError, match="NODES='x' is not a whole number"):
        plan_job(Request(cluster="dgxpod", nodes="x"))


@pytest.mark.slow
def test_a_login_node_install_renders_from_anywhere(tmp_path):
    """`pip install .` into a fresh venv without torch, then render dgxpod from elsewhere."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-c", str(REPO / "constraints.txt"), str(REPO)], check=True)
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = ["-m", "vitpod.workflows", "render", "--cluster", "dgxpod", "--model", "volo_d5"]
    done = subprocess.run(
        [python, *argv, "--run-root", str(tmp_path / "runs")],
        capture_output=True, text=True, cwd=elsewhere,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    script = Path(done.stdout.splitlines()[-1])
    assert script.is_file() and "#SBATCH --partition=dgxa100" in script.read_text()


def test_the_planner_knows_the_mesh(tmp_path):
    """TP stays inside a node; the memory fit is per mesh rank and names a layout that fits."""
    with pytest.raises(ConfigError, match="--tp 16 exceeds the 8 GPUs of a node"):
        plan_job(Request(cluster="dgxpod", model="vit_base_patch16_224", nodes=4,
                         args="--tp 16", run_root=str(tmp_path)))  # fmt: skip
    giant = plan_job(Request(cluster="dgxpod", model="vit_giant_patch14_224",
                             run_root=str(tmp_path)))  # fmt: skip
    assert "--fsdp" in giant.spec.command and giant.decision.engine.name == "fsdp"  # the recipe
    assert giant.memory["settings"]["mesh"] == {"dp": 40, "tp": 1, "pp": 1}
    with pytest.raises(ConfigError, match=r"does not fit in GPU memory.*--fsdp \(the cheapest"):
        plan_job(Request(cluster="dgxpod", model="vit_giant_patch14_224", args="--no-fsdp",
                         run_root=str(tmp_path)))  # fmt: skip
