"""The pipeline on the local profile (submitit's LocalExecutor runs each stage's job.sh: torchrun,
2 gloo ranks), followed live as
rich's table on a terminal, and its bad input."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from tests.helpers import profile_copy
from vitpod.registry import runfiles
from vitpod.registry.decision import read_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.pipeline.chain import Chain
from vitpod.workflows.site.profile import PROFILE_DIR
from vitpod.workflows.watching import status

REPO = Path(__file__).resolve().parents[1]
TINY = "--max-steps 6 --epochs 1 --workers 0 --loader torch --log-interval 1 -b 8"


@pytest.fixture(scope="module")
def followed(tmp_path_factory, digits_dir) -> tuple[Chain, int, str]:
    """One pipeline (pretrain, then finetune) followed live to its end, as on a terminal:
    the chain, follow()'s exit status and what it drew. The tests below read it."""
    tmp = tmp_path_factory.mktemp("pipeline")
    cluster = str(profile_copy(tmp, "local", data=digits_dir.parent))
    run = Chain(cluster, "volo_tiny", args=TINY, run_root=str(tmp / "runs")).submit()
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150, color_system=None)
    code = run.follow(interval=0.5, console=console)
    return run, code, out.getvalue()


@pytest.mark.slow
def test_pipeline_follow_live_view_ends_with_the_report(followed):
    run, code, text = followed
    assert code == 0
    # The live table's columns, both stages finished with all their steps, then the report.
    for column in ("state", "jobs", "restarts", "step", "loss", "images/s", "ETA", "ckpt age"):
        assert column in text
    assert text.count("COMPLETED") >= 2 and "6/6" in text
    found = re.findall(r"report: (\S+)", text)
    assert found and Path(found[-1]) == run.directory / "report.json", text[-500:]
    report = Path(found[-1])
    stages = json.loads(report.read_text())["stages"]
    assert [stages[s]["state"] for s in ("pretrain", "finetune")] == ["COMPLETED"] * 2
    assert stages["finetune"]["steps"] == 6


@pytest.mark.slow
def test_local_pipeline_runs_both_stages(followed):
    run = followed[0]
    report = run.wait(timeout=300, poll_s=1)

    pre, fin = (Path(report["stages"][s]["run_dir"]) for s in ("pretrain", "finetune"))
    assert [report["stages"][s]["state"] for s in ("pretrain", "finetune")] == ["COMPLETED"] * 2
    assert report["stages"]["finetune"]["steps"] == 6
    assert (pre / "final" / "model.pt").is_file() and (fin / "final" / "model.pt").is_file()
    # The finetune really started from the pretrain's final model, at the finetune size.
    fin_config = json.loads((fin / "config.json").read_text())
    assert fin_config["finetune"] == str(pre) and fin_config["img_size"] == 64
    # The stage ran its kept job.sh (torchrun over both ranks), one log as make pretrain's.
    fin_logs = sorted(p.name for p in (fin / "logs").glob("*.log"))
    assert len(fin_logs) == 1 and fin_logs[0].startswith("local-"), fin_logs
    assert "fine-tuning from" in (fin / "logs" / fin_logs[0]).read_text()
    # The manifest carries the submitted job; plan.json the engine the trainer ran.
    manifest = json.loads((fin / "manifest.json").read_text())
    assert manifest["job_ids"] == report["stages"]["finetune"]["job_ids"]
    decision = read_decision(fin)
    assert decision.engine.name == "ring" and decision.costs.predicted_comm_s > 0
    assert "--exchange" not in manifest["resolved"]["command"]
    assert "engine: ring (cost model)" in (fin / "logs" / fin_logs[0]).read_text()

    record = json.loads((run.directory / runfiles.PIPELINE).read_text())
    assert {s["state"] for s in record["stages"].values()} == {"COMPLETED"}
    shown = {s.name: s for s in status.run_status(run.directory)}
    assert shown["finetune"].step == 6 and shown["finetune"].images_per_s > 0
    assert shown["pretrain"].traceback is None


def test_failed_stage_reports_root_cause_and_cancels_finetune(tmp_path, digits_dir):
    cluster = str(profile_copy(tmp_path, "local", data=digits_dir.parent))
    # A bad flag is refused by the planner, before anything runs ...
    with pytest.raises(ConfigError, match="--num-classes must be at least 1"):
        Chain(cluster, "volo_tiny", args=TINY + " --num-classes 0").plan()
    # ... a mismatch only the data can reveal is refused inside the job (exit 2 on every rank).
    bad = TINY + " --num-classes 3"
    run = Chain(cluster, "volo_tiny", args=bad, run_root=str(tmp_path / "runs")).submit()
    with pytest.raises(Exception, match="pretrain") as err:
        run.wait(timeout=120, poll_s=1)
    shown = {s.name: s.state for s in run.status()}
    assert shown["finetune"] == "CANCELLED"
    assert "pretrain ended FAILED" in str(err.value)
    assert "10 classes" in str(err.value)


def test_missing_partition_fails_before_anything_is_written(tmp_path):
    cluster = str(
        profile_copy(
            tmp_path, "local", partitions={"pretrain": {"name": "local", "time": "01:00:00"}}
        )
    )
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError, match="partitions.finetune is missing"):
        Chain(cluster, "volo_tiny", run_root=str(runs)).submit()
    assert not runs.exists()


def test_missing_shared_data_path_fails_before_submission(tmp_path):
    cluster = str(profile_copy(tmp_path, "local", data=tmp_path / "no" / "such" / "dir"))
    runs = tmp_path / "runs"
    # volo_d1 reads an image folder (volo_tiny's digits are generated by the trainer).
    with pytest.raises(ConfigError, match="storage.data path .* does not exist"):
        Chain(cluster, "volo_d1", run_root=str(runs)).submit()
    assert not runs.exists()


def test_slurm_pipeline_shares_the_sbatch_requeue_rule_and_submit_check(tmp_path, monkeypatch):
    from vitpod.workflows.planning.plan import Request, plan_job

    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    profile = tmp_path / "localslurm.yaml"
    profile.write_text(yaml.safe_dump({**data, "storage": {"data": str(tmp_path)}}))
    (tmp_path / "digits").mkdir()
    job = plan_job(Request(cluster=str(profile), model="volo_tiny", run_root=str(tmp_path)))
    teardown = list(job.launch.teardown_lines)  # a chain stage sbatches this very job.sbatch
    assert "\n".join(teardown) in job.script
    assert any("[ -e " in line and "requeue-${SLURM_JOB_ID}-restart" in line for line in teardown)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no sbatch: not a login node
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError, match="sbatch is not on PATH"):
        Chain(str(profile), "volo_tiny", run_root=str(runs)).submit()
    assert not runs.exists()


def test_pipeline_honours_the_run_root_variable_like_render(tmp_path, monkeypatch):
    cluster = str(profile_copy(tmp_path, "local", data=tmp_path))
    (tmp_path / "digits").mkdir()
    monkeypatch.setenv("VITPOD_RUN_ROOT", str(tmp_path / "env-runs"))
    run = Chain(cluster, "volo_tiny")
    records = run.plan()  # validates and names everything, writes nothing
    assert run.directory is not None and run.directory.parent == tmp_path / "env-runs"
    assert records["pretrain"].run_dir == run.directory / "pretrain"
    assert not (tmp_path / "env-runs").exists()


def test_finetune_without_pretrain_checkpoint(tmp_path):
    empty = tmp_path / "pretrain-run"
    (empty / "checkpoints").mkdir(parents=True)
    for source in (empty, tmp_path / "missing"):
        with pytest.raises(ConfigError, match="has no model|does not exist"):
            Chain("local", "volo_tiny", finetune_from=str(source), run_root=str(tmp_path)).plan()
    with pytest.raises(ConfigError, match="needs finetune_from"):
        Chain("local", "volo_tiny", stages=("finetune",))


def test_make_status_and_pipeline_cli_errors(tmp_path, capsys):
    from vitpod.workflows.cli import main

    assert main(["status", "--run", ""]) == 2
    assert main(["pipeline", "--cluster", "nosuch", "--model", "volo_tiny"]) == 2
    assert "unknown profile 'nosuch'" in capsys.readouterr().err


def test_orchestrator_imports_without_torch():
    code = (
        "import sys, importlib.abc\n"
        "class B(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'timm', 'numpy'): raise ImportError(name)\n"
        "sys.meta_path.insert(0, B())\n"
        "import vitpod.workflows.pipeline.chain, vitpod.workflows.pipeline.demo\n"
        "import vitpod.workflows.watching.status\n"
        "import vitpod.workflows.jobs.jobstate\n"
        "import vitpod.workflows.planning.exchange\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
