"""Scaling sweep: bad input stops before anything is written; each point's own job script, sized
to the point (nodes, ranks, a time limit from the step-time model), and the study's node-hours."""

import json
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.helpers import make, profile_copy
from vitpod.registry.decision import read_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.studies.pointsize import FLOOR_S, MARGIN, slurm_time
from vitpod.workflows.studies.scaling import main, parse_gpus, per_rank_batches, placement_of

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
        (["--cluster", "local"], "a scaling sweep is Slurm jobs"),
    ]
    for args, message in cases:
        with pytest.raises(ConfigError, match=message):
            run(tmp_path, *args)
        assert not (tmp_path / "study").exists()


def test_args_a_point_sets_itself_are_refused_naming_the_make_variable(tmp_path):
    """ARGS="--max-steps 3000" was replaced by the study's 30 steps without a word."""
    for args, message in [
        ("--max-steps 3000", "--max-steps is set by the study for every point; use STEPS="),
        ("--drop-path 0.1 -b 64", "-b is set by the study .* use BATCH="),
        ("--grad-accum-steps=2", "--grad-accum-steps is set .* use ACCUM="),
    ]:
        with pytest.raises(ConfigError, match=message):
            run(tmp_path, f"--args={args}")
        assert not (tmp_path / "study").exists()


def test_make_scaling_steps_reach_every_point(tmp_path):
    out = make("scaling", "CLUSTER=localslurm", "MODEL=volo_tiny", "GPUS=1 2", "STEPS=12",
               "OFFLINE=1", runs=tmp_path / "runs")  # fmt: skip
    assert out.returncode == 0, out.stderr
    plans = sorted((tmp_path / "runs").rglob("plan.json"))
    assert len(plans) == 2
    assert all(read_decision(p.parent).trainer.optim["max_steps"] == 12 for p in plans)


def test_existing_study_dir_is_refused(tmp_path):
    (tmp_path / "study").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        run(tmp_path)


def test_batch_arithmetic():
    assert per_rank_batches("strong", [1, 2, 4], 32, 2) == {1: 16, 2: 8, 4: 4}
    assert per_rank_batches("weak", [1, 2, 4], 8, 2) == {1: 8, 2: 8, 4: 8}
    assert parse_gpus("4, 1 2") == [1, 2, 4]
    assert placement_of(2, 2, 2, "p") == (1, 2)
    assert placement_of(4, 2, 2, "p") == (2, 2)
    assert placement_of(1, 8, 5, "p") == (1, 1)
    assert [slurm_time(s) for s in (1, 600, 601, 86400 + 5400)] == [
        "0:01:00", "0:10:00", "0:11:00", "1-01:30:00",
    ]  # fmt: skip


def header(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_rendered_point_scripts(tmp_path, capsys):
    quirky = "--loader torch --workers 0"
    assert (
        run(tmp_path, "--mode", "strong", "--gpus", "1 2 4", "--batch", "16", "--args", quirky) == 0
    )
    study_dir = tmp_path / "study"
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-3:] == [str(study_dir / f"gpus{g}" / "job.sbatch") for g in (1, 2, 4)]
    assert not (study_dir / "sweep.sbatch").exists()
    for gpus, nodes, per_node, batch in ((1, 1, 1, 16), (2, 1, 2, 8), (4, 2, 2, 4)):
        run_dir = study_dir / f"gpus{gpus}"
        script = (run_dir / "job.sbatch").read_text()
        # its own allocation, not the largest point's; the profile (localslurm) is not exclusive
        head = set(header(script))
        assert {f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={per_node}",
                f"#SBATCH --output={run_dir}/logs/sbatch-%j.out"} <= head  # fmt: skip
        assert "#SBATCH --exclusive" not in script and "--array" not in script
        assert f"--plan {run_dir}/plan.json" in script  # the ranks start from it
        record = read_decision(run_dir)
        trainer = record.trainer
        assert trainer.run["output"] == str(run_dir)
        assert (record.resources.nodes, record.resources.tasks_per_node) == (nodes, per_node)
        assert record.resources.world_size == gpus
        # The point's batch and steps are fields set over the recipe's and ARGS
        # (Request.overrides, kept with the request), not tokens in its command.
        assert trainer.optim["batch_size"] == batch and trainer.optim["max_steps"] == 30
        assert trainer.run["warmup_steps_excluded"] == 10 and trainer.data["workers"] == 0
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["request"]["overrides"] == {
            "batch_size": batch, "accum_steps": 1, "max_steps": 30, "warmup_steps_excluded": 10,
            "log_interval": 1,
        }  # fmt: skip
        command = manifest["resolved"]["command"]
        assert not {"--max-steps", "--accum-steps", "--log-interval"} & set(command)
        assert command[-4:] == ["--loader", "torch", "--workers", "0"]  # ARGS last, as given
        assert record.engine.name == "ring" == trainer.parallel["exchange"]
        assert (run_dir / "bind.sh").is_file() and (run_dir / "manifest.json").is_file()
        assert subprocess.run(["bash", "-n", str(run_dir / "job.sbatch")]).returncode == 0
        if shutil.which("shellcheck"):
            check = subprocess.run(["shellcheck", str(run_dir / "job.sbatch")], capture_output=True)
            assert check.returncode == 0, check.stdout.decode()
    study = json.loads((study_dir / "study.json").read_text())
    assert [p["global_batch"] for p in study["points"]] == [16, 16, 16]
    assert [p["batch_size"] for p in study["points"]] == [16, 8, 4]
    assert [p["job_id"] for p in study["points"]] == [None, None, None]  # rendered only
    assert study["mode"] == "strong" and study["fabric"]["gpus_per_node"] == 2
    assert study["grad_bytes"] == 4 * 161_045
    assert study["points"][0]["predicted_comm_s"] == 0.0
    assert study["points"][2]["predicted_comm_s"] > study["points"][1]["predicted_comm_s"] > 0


def earlier_run(root, model="vit_base_patch16_224", batch=128, world=8, step_s=0.4, comm_s=0.03):
    """A finished run on one DGX A100 in the run root: config.json and rank 0's records (as
    tests/test_placement.py's), what the step-time model reads."""
    run = root / f"20000101T000000Z-{model}-pretrain-aaaaaa"
    (run / "metrics").mkdir(parents=True)
    config = {"model": model, "img_size": 224, "batch_size": batch, "accum_steps": 1,
              "world_size": world, "epochs": 1, "max_steps": 100, "data_dir": "x"}  # fmt: skip
    (run / "config.json").write_text(json.dumps(config))
    records = [{"kind": "mfu", "device": "NVIDIA A100-SXM4-80GB"}]  # what the steps ran on
    records += [{"kind": "step", "step": s, "world_size": world, "warmup": s < 3,
                 "total_steps": 100, "wall_time": 1000.0 + s * step_s,
                 "time": {"step": step_s, "comm": comm_s}} for s in range(1, 101)]  # fmt: skip
    (run / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_a_dgxpod_study_is_sized_per_point(tmp_path, capsys):
    """Issue 45: a ViT-B strong study on dgxpod held --nodes=5 --time=2-00:00:00 for every point.
    Each point's script now has its own nodes, its own time from the step-time model (an
    earlier ViT-B run on one DGX measured 0.4 s a step), --exclusive as the profile asks, and
    the study's node-hours are printed; TIME= wins over the model."""
    root = tmp_path / "runs"
    earlier_run(root)
    argv = ["--cluster", "dgxpod", "--model", "vit_base_patch16_224", "--mode", "strong",
            "--gpus", "8 16 32", "--batch", "1024", "--steps", "3000", "--offline",
            "--run-root", str(root)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    (study_dir,) = (root / "studies").iterdir()
    study = json.loads((study_dir / "study.json").read_text())
    times = []
    for point, nodes in zip(study["points"], (1, 2, 4), strict=True):
        head = header((study_dir / point["run_dir"] / "job.sbatch").read_text())
        assert f"#SBATCH --nodes={nodes}" in head and "#SBATCH --exclusive" in head
        assert "#SBATCH --ntasks-per-node=8" in head and "#SBATCH --gpus-per-node=8" in head
        # the model's run x the margin (at least the floor), not the partition's 2 days
        assert point["predicted_run_s"] > 3000 * 0.1
        assert point["time"] == slurm_time(max(FLOOR_S, MARGIN * point["predicted_run_s"]))
        assert f"#SBATCH --time={point['time']}" in head
        assert read_decision(study_dir / point["run_dir"]).resources.time == point["time"]
        times.append(point["time"])
        assert f"--time={point['time']} (1.5 x the predicted" in out
    # the 1-node point is the measured layout: 3000 steps x 0.4 s (+ start-up and its save)
    assert study["points"][0]["predicted_run_s"] >= 3000 * 0.4
    assert len(set(times[:2])) == 2  # each point its own
    hours = sum(n * int(t.split(":")[0]) + n * int(t.split(":")[1]) / 60
                for n, t in zip((1, 2, 4), times, strict=True))  # fmt: skip
    assert study["node_hours"] == pytest.approx(hours, abs=1e-3)
    assert f"study: 3 point job(s) run one after another, {hours:.3g} node-hours at most" in out

    # a profile that does not ask for whole nodes gets none; TIME= wins over the model
    capsys.readouterr()
    lent = profile_copy(tmp_path, "dgxpod", name="shared", exclusive=False)
    argv[1] = str(lent)
    assert main([*argv, "--time", "3:00:00", "--gpus", "8 16"]) == 0
    out = capsys.readouterr().out
    (shared,) = [s for s in (root / "studies").iterdir() if s != study_dir]
    for point in json.loads((shared / "study.json").read_text())["points"]:
        head = header((shared / point["run_dir"] / "job.sbatch").read_text())
        assert "#SBATCH --time=3:00:00" in head and "#SBATCH --exclusive" not in head
        assert point["time_source"] == "TIME="
    assert "study: 2 point job(s) run one after another, 9 node-hours at most" in out


def test_a_point_without_a_prediction_keeps_the_partitions_limit_and_says_why(tmp_path, capsys):
    assert run(tmp_path, "--gpus", "1 2") == 0
    out = capsys.readouterr().out
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    assert [p["time"] for p in study["points"]] == ["00:30:00", "00:30:00"]
    assert "--time=00:30:00 (the partition's limit; no prediction: no earlier run" in out
    assert "study: 2 point job(s) run one after another, 1 node-hours at most" in out


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
    script = (study_dir / "gpus1" / "job.sbatch").read_text()
    assert f"RUN_DIR={shlex.quote(str(study_dir / 'gpus1'))}\n" in script
    assert read_decision(study_dir / "gpus1").trainer.data["aa"] == "x; touch /tmp/pwned"
    assert f"--plan {shlex.quote(str(study_dir / 'gpus1' / 'plan.json'))}" in script
    assert f'#SBATCH --output="{study_dir}/gpus1/logs/sbatch-%j.out"' in script
    assert subprocess.run(["bash", "-n", str(study_dir / "gpus1" / "job.sbatch")]).returncode == 0


def test_each_point_keeps_its_requeue_marker_where_its_teardown_looks(tmp_path):
    from vitpod.workflows.studies.scaling import build_parser, prepare

    ns = build_parser().parse_args([*BASE, "--study-dir", str(tmp_path / "study"), "--gpus", "2"])
    (plan,) = prepare(ns).plans
    marker = f"{tmp_path / 'study' / 'gpus2'}/logs/" + '"requeue-${SLURM_JOB_ID}'
    assert any(line.startswith("if ") and marker in line for line in plan.launch.teardown_lines)
    assert f"export VITPOD_REQUEUE_MARKER={marker}" in plan.launch.bind_script


def test_forced_parameter_server_gets_a_server_on_every_rank(tmp_path):
    assert run(tmp_path, "--gpus", "1 2 4", "--args", "--exchange ps") == 0
    for gpus in (1, 2, 4):
        script = (tmp_path / "study" / f"gpus{gpus}" / "job.sbatch").read_text()
        assert "--exchange" not in script  # the ranks' settings are in the point's plan.json
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


def test_points_are_submitted_one_after_another_and_a_refusal_cancels_the_earlier(
    tmp_path, monkeypatch
):
    """sbatch (a fake runner: no Slurm) takes point 0, then point 1 with afterany on it on the
    command line (the kept script unchanged), and refuses point 2: point 1 and 0 are cancelled
    with one scancel, the study directory is kept with their ids, and the error says so."""
    from vitpod.workflows import slurm
    from vitpod.workflows.studies.scaling import build_parser, materialize, prepare, submit_points

    asked: list[list[str]] = []

    def runner(argv, *, timeout, input=None, cwd=None):
        asked.append(argv)
        if argv[0] == "sbatch" and len([a for a in asked if a[0] == "sbatch"]) == 3:
            return subprocess.CompletedProcess(argv, 1, "", "sbatch: error: QOSMaxNodeLimit\n")
        job = str(100 + len(asked))
        return subprocess.CompletedProcess(argv, 0, f"{job}\n" if argv[0] == "sbatch" else "", "")

    ns = build_parser().parse_args([*BASE, "--study-dir", str(tmp_path / "study"),
                                    "--gpus", "1 2 4"])  # fmt: skip
    sweep = prepare(ns)
    scripts = materialize(sweep)
    monkeypatch.setattr(slurm, "runner", runner)
    with pytest.raises(ConfigError, match=r"point 4: .*QOSMaxNodeLimit.*\(101,102\): cancelled"):
        submit_points(sweep, scripts)
    sbatch = [a for a in asked if a[0] == "sbatch"]
    assert sbatch[0] == ["sbatch", "--parsable", str(scripts[0])]
    assert sbatch[1] == ["sbatch", "--parsable", "--dependency=afterany:101", str(scripts[1])]
    assert sbatch[2][2] == "--dependency=afterany:102"
    assert asked[-1] == ["scancel", "101", "102"]
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    assert [p["job_id"] for p in study["points"]] == ["101", "102", None]
    assert "#SBATCH --dependency" not in scripts[1].read_text()
    assert json.loads((scripts[1].parent / "manifest.json").read_text())["job_ids"] == ["102"]
