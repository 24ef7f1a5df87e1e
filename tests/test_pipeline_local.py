"""The pipeline on the local profile (submitit LocalExecutor, 2 gloo ranks) and its bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workflows import status
from workflows.errors import ConfigError
from workflows.pipeline import Pipeline
from workflows.profile import PROFILE_DIR

REPO = Path(__file__).resolve().parents[1]
TINY = "--max-steps 6 --epochs 1 --workers 0 --loader torch --log-interval 1 -b 8"


def _profile(tmp_path: Path, **changes) -> str:
    """A copy of the bundled local profile with some fields changed, as CLUSTER=./file.yaml."""
    data = yaml.safe_load((PROFILE_DIR / "local.yaml").read_text())
    data.update(changes)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.slow
def test_local_pipeline_runs_both_stages(tmp_path, digits_dir):
    cluster = _profile(tmp_path, storage={"data": str(digits_dir.parent)})
    run = Pipeline(cluster, "volo_tiny", args=TINY, run_root=str(tmp_path / "runs")).submit()
    report = run.wait(timeout=300, poll_s=1)

    pre, fin = (Path(report["stages"][s]["run_dir"]) for s in ("pretrain", "finetune"))
    assert [report["stages"][s]["state"] for s in ("pretrain", "finetune")] == ["COMPLETED"] * 2
    assert report["stages"]["finetune"]["steps"] == 6
    assert (pre / "final" / "model.pt").is_file() and (fin / "final" / "model.pt").is_file()
    # The finetune really started from the pretrain's final model, at the finetune size.
    fin_config = json.loads((fin / "config.json").read_text())
    assert fin_config["finetune"] == str(pre) and fin_config["img_size"] == 64
    fin_logs = sorted(p.name for p in (fin / "logs").iterdir())
    assert len(fin_logs) == 2 and all("-restart0-rank" in n for n in fin_logs)
    assert "fine-tuning from" in (fin / "logs" / fin_logs[0]).read_text()
    # Manifests carry the submitted job, the topology decision, and the resolved command.
    manifest = json.loads((fin / "manifest.json").read_text())
    assert manifest["job_ids"] == report["stages"]["finetune"]["job_ids"]
    assert manifest["topology"]["topology"] == "ring" and manifest["topology"]["predicted_s"] > 0
    assert manifest["resolved"]["command"][-2:] == ["--topology", "ring"]

    record = json.loads((run.directory / status.PIPELINE_FILE).read_text())
    assert {s["state"] for s in record["stages"].values()} == {"COMPLETED"}
    shown = {s.stage: s for s in status.run_status(run.directory)}
    assert shown["finetune"].last_step == 6 and shown["finetune"].images_per_s > 0
    assert shown["pretrain"].traceback is None


def test_failed_stage_reports_root_cause_and_cancels_finetune(tmp_path, digits_dir):
    cluster = _profile(tmp_path, storage={"data": str(digits_dir.parent)})
    # A configuration the trainer refuses inside the job (exit 2 on every rank).
    bad = TINY + " --num-classes 0"
    run = Pipeline(cluster, "volo_tiny", args=bad, run_root=str(tmp_path / "runs")).submit()
    with pytest.raises(Exception, match="pretrain") as err:
        run.wait(timeout=120, poll_s=1)
    shown = {s.stage: s.state for s in run.status()}
    assert shown["finetune"] == "CANCELLED"
    assert "pretrain ended FAILED" in str(err.value)
    assert "--num-classes must be at least 1" in str(err.value)


def test_missing_partition_fails_before_anything_is_written(tmp_path):
    cluster = _profile(tmp_path, partitions={"pretrain": {"name": "local", "time": "01:00:00"}})
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError, match="partitions.finetune is missing"):
        Pipeline(cluster, "volo_tiny", run_root=str(runs)).submit()
    assert not runs.exists()


def test_missing_shared_data_path_fails_before_submission(tmp_path):
    cluster = _profile(tmp_path, storage={"data": str(tmp_path / "no" / "such" / "dir")})
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError, match="storage.data path .* does not exist"):
        Pipeline(cluster, "volo_tiny", run_root=str(runs)).submit()
    assert not runs.exists()


def test_slurm_pipeline_shares_the_sbatch_requeue_rule_and_submit_check(tmp_path, monkeypatch):
    from workflows.cli import prepare, stage_parser
    from workflows.pipeline import make_executor

    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    profile = tmp_path / "localslurm.yaml"
    profile.write_text(yaml.safe_dump({**data, "storage": {"data": str(tmp_path)}}))
    (tmp_path / "digits").mkdir()
    argv = ["--cluster", str(profile), "--model", "volo_tiny", "--run-root", str(tmp_path)]
    job = prepare(stage_parser("pipeline").parse_args(argv))
    teardown = list(make_executor(job, None).parameters["teardown"])
    assert teardown == list(job.plan.teardown_lines)
    assert "\n".join(teardown) in job.script  # job.sbatch runs the very same lines after srun
    assert any("[ -e " in line and "requeue-${SLURM_JOB_ID}-restart" in line for line in teardown)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no sbatch: not a login node
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError, match="sbatch is not on PATH"):
        Pipeline(str(profile), "volo_tiny", run_root=str(runs)).submit()
    assert not runs.exists()


def test_pipeline_honours_the_run_root_variable_like_render(tmp_path, monkeypatch):
    cluster = _profile(tmp_path, storage={"data": str(tmp_path)})
    (tmp_path / "digits").mkdir()
    monkeypatch.setenv("VITPOD_RUN_ROOT", str(tmp_path / "env-runs"))
    run = Pipeline(cluster, "volo_tiny")
    records = run.plan()  # validates and names everything, writes nothing
    assert run.directory is not None and run.directory.parent == tmp_path / "env-runs"
    assert records["pretrain"].run_dir == run.directory / "pretrain"
    assert not (tmp_path / "env-runs").exists()


def test_finetune_without_pretrain_checkpoint(tmp_path):
    empty = tmp_path / "pretrain-run"
    (empty / "checkpoints").mkdir(parents=True)
    for source in (empty, tmp_path / "missing"):
        with pytest.raises(ConfigError, match="no pretrain checkpoint"):
            Pipeline("local", "volo_tiny", finetune_from=str(source), run_root=str(tmp_path)).plan()
    with pytest.raises(ConfigError, match="needs finetune_from"):
        Pipeline("local", "volo_tiny", stages=("finetune",))


def test_make_status_and_pipeline_cli_errors(tmp_path, capsys):
    from workflows.cli import main

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
        "import workflows.pipeline, workflows.demo, workflows.status, workflows.jobstate\n"
        "import workflows.topology\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
