"""Scaling sweep: bad input stops before anything is written; the rendered array script."""

import json
import shlex
import shutil
import subprocess
import sys

import pytest

from vitpod.registry.decision import read_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.studies.scaling import main, parse_gpus, per_rank_batches, placement

BASE = ["--cluster", "localslurm", "--model", "volo_tiny", "--render-only"]


def run(tmp_path, *args):
    return main([*BASE, "--study-dir", str(tmp_path / "study"), *args])


def test_strong_batch_must_divide_over_every_point(tmp_path):
    with pytest.raises(ConfigError, match=r"BATCH=10 .* does not divide over GPUS \[4\]"):
        run(tmp_path, "--mode", "strong", "--gpus", "1 2 4", "--batch", "10")
    assert not (tmp_path / "study").exists()
    with pytest.raises(ConfigError, match=r"ACCUM=2; choose a multiple of 8"):
        run(tmp_path, "--mode", "strong", "--gpus", "1 2 4", "--batch", "12", "--accum", "2")


def test_bad_sweep_inputs_name_the_field(tmp_path):
    cases = [
        (["--mode", "medium"], "MODE='medium'"),
        (["--gpus", ""], "GPUS is empty"),
        (["--gpus", "1 two"], "whole number"),
        (["--gpus", "2 2"], "distinct"),
        (["--gpus", "3"], "3 does not fill whole nodes of 2"),
        (["--gpus", "8"], "needs 4 nodes but profile localslurm has nodes=2"),
        (["--batch", "0"], "BATCH=0"),
        (["--accum", "x"], "ACCUM='x'"),
        (["--steps", "5", "--warmup", "5"], "--warmup=5"),
        (["--cluster", "local"], "a scaling sweep is a Slurm job array"),
    ]
    for args, message in cases:
        with pytest.raises(ConfigError, match=message):
            run(tmp_path, *args)
        assert not (tmp_path / "study").exists()


def test_existing_study_dir_is_refused(tmp_path):
    (tmp_path / "study").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        run(tmp_path)


def test_batch_arithmetic():
    assert per_rank_batches("strong", [1, 2, 4], 32, 2) == {1: 16, 2: 8, 4: 4}
    assert per_rank_batches("weak", [1, 2, 4], 8, 2) == {1: 8, 2: 8, 4: 8}
    assert parse_gpus("4, 1 2") == [1, 2, 4]
    assert placement(2, 2, 2, "p") == (1, 2)
    assert placement(4, 2, 2, "p") == (2, 2)
    assert placement(1, 8, 5, "p") == (1, 1)


def test_rendered_array_script(tmp_path, capsys):
    quirky = "--loader torch --workers 0"
    assert (
        run(tmp_path, "--mode", "strong", "--gpus", "1 2 4", "--batch", "16", "--args", quirky) == 0
    )
    study_dir = tmp_path / "study"
    script = (study_dir / "sweep.sbatch").read_text()
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(study_dir / "sweep.sbatch")
    assert script.splitlines()[1] == "#SBATCH --array=0-2%1"
    assert "#SBATCH --nodes=2" in script  # every task holds the largest point's allocation
    assert f"#SBATCH --output={study_dir}/logs/sweep-%A_%a.out" in script
    for index, (gpus, nodes, batch) in enumerate(((1, 1, 16), (2, 1, 8), (4, 2, 4))):
        block = script.split(f"  {index})  #")[1].split(";;")[0]
        assert f"NODES={nodes} NTASKS={gpus}" in block
        assert f"      --plan {study_dir}/gpus{gpus}/plan.json\n" in block  # ranks start from it
        record = read_decision(study_dir / f"gpus{gpus}")
        trainer = record.trainer
        assert trainer.run["output"] == f"{study_dir}/gpus{gpus}"
        # The sweep's own batch comes after the recipe's, so it wins (argparse: last one).
        assert trainer.optim["batch_size"] == batch and trainer.optim["max_steps"] == 30
        assert trainer.run["warmup_steps_excluded"] == 10 and trainer.data["workers"] == 0
        assert record.engine.name == "ring" == trainer.parallel["exchange"]
        assert (study_dir / f"gpus{gpus}" / "bind.sh").is_file()
    study = json.loads((study_dir / "study.json").read_text())
    assert [p["global_batch"] for p in study["points"]] == [16, 16, 16]
    assert [p["batch_size"] for p in study["points"]] == [16, 8, 4]
    assert study["mode"] == "strong" and study["fabric"]["gpus_per_node"] == 2
    assert study["grad_bytes"] == 4 * 161_045
    assert study["points"][0]["predicted_comm_s"] == 0.0
    assert study["points"][2]["predicted_comm_s"] > study["points"][1]["predicted_comm_s"] > 0
    assert subprocess.run(["bash", "-n", str(study_dir / "sweep.sbatch")]).returncode == 0
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", str(study_dir / "sweep.sbatch")], capture_output=True)
        assert check.returncode == 0, check.stdout.decode()


def test_study_json_is_readable_by_analysis(tmp_path):
    from vitpod.analysis.scaling import load_study, scaling_table

    assert run(tmp_path, "--mode", "weak", "--gpus", "1 2", "--batch", "8") == 0
    study = load_study(tmp_path / "study")
    rows = scaling_table(study)
    # Nothing ran yet: every point is reported as failed, none dropped.
    assert [(r.gpus, r.state) for r in rows] == [(1, "failed"), (2, "failed")]


def test_scaling_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; "
        "import vitpod.workflows.studies.scaling; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_hostile_paths_and_args_are_quoted(tmp_path):
    study_dir = tmp_path / "it's a study; echo pwned"
    args = "--loader torch --aa 'x; touch /tmp/pwned'"
    assert main([*BASE, "--study-dir", str(study_dir), "--gpus", "1 2", "--args", args]) == 0
    script = (study_dir / "sweep.sbatch").read_text()
    assert f"RUN_DIR={shlex.quote(str(study_dir / 'gpus1'))} " in script
    assert read_decision(study_dir / "gpus1").trainer.data["aa"] == "x; touch /tmp/pwned"
    assert f"--plan {shlex.quote(str(study_dir / 'gpus1' / 'plan.json'))}" in script
    assert f'#SBATCH --output="{study_dir}/logs/sweep-%A_%a.out"' in script
    assert subprocess.run(["bash", "-n", str(study_dir / "sweep.sbatch")]).returncode == 0


def test_sweep_shares_the_requeue_rule_and_marker(tmp_path):
    from vitpod.workflows.planning.spec import launch_for
    from vitpod.workflows.studies.scaling import build_parser, prepare

    ns = build_parser().parse_args([*BASE, "--study-dir", str(tmp_path / "study"), "--gpus", "2"])
    sweep = prepare(ns)
    teardown = launch_for(sweep.spec).teardown_lines
    assert "\n".join(teardown) in sweep.script  # the same lines as job.sbatch, after srun
    marker = f"{tmp_path / 'study'}/logs/" + '"requeue-${SLURM_JOB_ID}'
    assert any(line.startswith("if ") and marker in line for line in teardown)
    # Each point's bind.sh leaves its marker where that teardown looks.
    bind = sweep.points[0].bind_script
    assert f"export VITPOD_REQUEUE_MARKER={marker}" in bind


def test_forced_parameter_server_gets_a_server_on_every_rank(tmp_path):
    assert run(tmp_path, "--gpus", "1 2 4", "--args", "--exchange ps") == 0
    script = (tmp_path / "study" / "sweep.sbatch").read_text()
    for index, gpus in enumerate((1, 2, 4)):
        block = script.split(f"  {index})  #")[1].split(";;")[0]
        assert "--exchange" not in block  # the ranks' settings are in the point's plan.json
        record = read_decision(tmp_path / "study" / f"gpus{gpus}")
        assert (record.engine.name, record.engine.ps_servers) == ("ps", gpus)
        assert (record.trainer.parallel["exchange"], record.trainer.parallel["ps_servers"]) == (
            "ps",
            gpus,
        )


def _localslurm_copy(tmp_path, data):
    import yaml

    from vitpod.workflows.site.profile import PROFILE_DIR

    profile = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    profile["storage"] = {**profile["storage"], "data": str(data)}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return str(path)


def test_missing_shared_data_is_refused_before_anything_is_written(tmp_path):
    if shutil.which("sbatch") is None:
        pytest.skip("needs sbatch on PATH (the Slurm client) to get past the login-node check")
    cluster = _localslurm_copy(tmp_path, tmp_path / "no" / "such" / "data")
    # volo_d1 reads an image folder; the digits of volo_tiny are generated by the trainer.
    argv = ["--cluster", cluster, "--model", "volo_d1", "--gpus", "1 2"]
    with pytest.raises(ConfigError, match=r"storage\.data path .*no/such/data' does not"):
        main([*argv, "--study-dir", str(tmp_path / "study")])
    assert not (tmp_path / "study").exists()
    # Rendering only (for another cluster, from anywhere) needs no shared path.
    assert main([*argv, "--render-only", "--study-dir", str(tmp_path / "study")]) == 0


def test_unsafe_study_dir_and_run_root_variable(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="study directory .*choose another --study-dir"):
        main([*BASE, "--study-dir", str(tmp_path / "100%")])
    monkeypatch.setenv("VITPOD_RUN_ROOT", str(tmp_path / "root"))
    assert main([*BASE, "--gpus", "1"]) == 0
    (study,) = (tmp_path / "root" / "studies").iterdir()
    assert study.name.split("-")[1:3] == ["volo_tiny", "strong"]
