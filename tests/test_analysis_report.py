"""Scaling table arithmetic and the HTML report, on hand-made trainer logs with known answers."""

import base64
import json
import re
from pathlib import Path

import pytest

from vitpod.analysis import report, scaling
from vitpod.analysis.__main__ import main
from vitpod.analysis.runlogs import read_run
from vitpod.registry.paralleldims import ParallelDims

FABRIC = {
    "gpus_per_node": 2,
    "intra_bw": "1 GB/s",
    "intra_latency": "50 us",
    "nic_bw": "0.5 GB/s",
    "nics_per_node": 1,
    "inter_latency": "100 us",
}


def step_line(rank, world, step, batch, times, warmup=False):
    parts = dict(zip(("data", "compute", "comm", "optimizer"), times, strict=True))
    parts["step"] = sum(times)
    return {
        "kind": "step",
        "step": step,
        "epoch": 0,
        "rank": rank,
        "world_size": world,
        "batch_size": batch,
        "loss": 2.0,
        "lr": 1e-3,
        "images_per_s": batch / parts["step"],
        "time": parts,
        "peak_mem_bytes": 1000,
        "warmup": warmup,
    }


def write_run(run_dir, world, batch, images_per_s, comm_by_rank, summary=True, engine="ring"):
    """Each rank: 2 slow warmup steps, then 3 steps of data 10 ms, compute 50 ms, its comm,
    optimizer 5 ms. Returns nothing; the expected means are computed by the tests by hand."""
    (run_dir / "metrics").mkdir(parents=True)
    for rank in range(world):
        lines = [step_line(rank, world, s, batch, (1.0, 1.0, 1.0, 1.0), True) for s in range(2)]
        times = (0.010, 0.050, comm_by_rank[rank], 0.005)
        lines += [step_line(rank, world, s, batch, times) for s in range(2, 5)]
        if summary and rank == 0:
            lines.append(
                {
                    "kind": "summary",
                    "top1": 50.0,
                    "top5": 90.0,
                    "steps": 5,
                    "images_per_s": images_per_s,
                    "world_size": world,
                    "global_batch": batch * world,
                    "engine": engine,
                }
            )
        text = "".join(json.dumps(line) + "\n" for line in lines)
        (run_dir / "metrics" / f"rank{rank}.jsonl").write_text(text)


def write_study(root, mode, points, fabric=None, grad_bytes=None):
    study = {"mode": mode, "model": "volo_tiny", "batch": 32, "accum": 1, "points": points}
    if fabric:
        study.update(fabric=fabric, grad_bytes=grad_bytes)
    root.mkdir(parents=True, exist_ok=True)
    (root / "study.json").write_text(json.dumps(study))
    return root


@pytest.fixture
def strong_study(tmp_path):
    root = tmp_path / "study"
    # Global batch 32 split over 1, 2, 4 GPUs; an 8-GPU point that never wrote its summary.
    write_run(root / "g1", 1, 32, 100.0, [0.0])
    write_run(root / "g2", 2, 16, 180.0, [0.010, 0.030])
    write_run(root / "g4", 4, 8, 320.0, [0.020, 0.020, 0.040, 0.040])
    write_run(root / "g8", 8, 4, 500.0, [0.05] * 8, summary=False)
    points = [
        {"gpus": g, "nodes": 1 if g <= 2 else g // 2, "run_dir": f"g{g}"} for g in (4, 1, 8, 2)
    ]
    return write_study(root, "strong", points, FABRIC, 4e6)


def test_strong_table_matches_hand_computed(strong_study):
    rows = scaling.scaling_table(scaling.load_study(strong_study))
    assert [r.gpus for r in rows] == [1, 2, 4, 8]
    g1, g2, g4, g8 = rows
    assert [r.global_batch for r in (g1, g2, g4)] == [32, 32, 32]
    assert [r.images_per_s_per_gpu for r in (g1, g2, g4)] == pytest.approx([100, 90, 80])
    assert [r.speedup for r in (g1, g2, g4)] == pytest.approx([1.0, 1.8, 3.2])
    assert [r.ideal_speedup for r in (g1, g2, g4)] == pytest.approx([1, 2, 4])
    assert [r.efficiency for r in (g1, g2, g4)] == pytest.approx([1.0, 0.9, 0.8])
    # Warmup steps (1 s each) are excluded; comm is averaged over ranks: (10 + 30) / 2 ms.
    assert g2.time["comm"] == pytest.approx(0.020)
    assert g2.time["data"] == pytest.approx(0.010)
    assert g2.time["step"] == pytest.approx(0.085)
    assert g2.comm_pct == pytest.approx(100 * 0.020 / 0.085)
    assert g4.time["comm"] == pytest.approx(0.030)
    assert g8.state == "failed" and "no summary" in g8.error
    assert g8.speedup is None and g8.images_per_s is None


def test_predicted_comm_comes_from_the_record(strong_study):
    study = json.loads((strong_study / "study.json").read_text())
    for point in study["points"]:
        point["predicted_comm_s"] = 0.0041 if point["gpus"] == 2 else None
    (strong_study / "study.json").write_text(json.dumps(study))
    write_plan(strong_study / "g4", predicted_comm_s=0.012)
    rows = scaling.scaling_table(scaling.load_study(strong_study))
    g1, g2, g4 = rows[:3]
    assert g2.predicted_comm_s == pytest.approx(0.0041)  # the sweep's own record
    assert g4.predicted_comm_s == pytest.approx(0.012)  # the run's plan.json
    assert g4.comm_ratio == pytest.approx(0.030 / 0.012)
    # Nothing recorded: no prediction, although the study has a fabric to price one with.
    assert g1.predicted_comm_s is None and g1.comm_ratio is None


def write_plan(run_dir, predicted_comm_s):
    from vitpod.registry import decision as rec

    world = 4
    rec.write_decision(
        run_dir,
        rec.Decision(
            created="2026-01-01T00:00:00", stage="pretrain", model="volo_tiny",
            resources=rec.Resources(
                cluster="c", partition="p", node_type="n", nodes=2, tasks_per_node=2,
                world_size=world,
            ),
            layout=ParallelDims(dp=world),
            engine=rec.Engine(name="ring", source="cost model"),
            costs=rec.Costs(
                algorithm="ring", predicted_comm_s=predicted_comm_s, grad_bytes=4_000_000,
                per_algorithm_s={"ring": predicted_comm_s}, priced_by="profile fabric",
            ),
        ),
    )  # fmt: skip


def test_failed_smallest_point_moves_the_baseline(tmp_path):
    root = tmp_path / "study"
    (root / "g1").mkdir(parents=True)  # the 1-GPU job never started
    write_run(root / "g2", 2, 16, 200.0, [0.01, 0.01])
    write_run(root / "g4", 4, 8, 360.0, [0.01] * 4)
    points = [{"gpus": g, "run_dir": f"g{g}"} for g in (1, 2, 4)]
    rows = scaling.scaling_table(scaling.load_study(write_study(root, "strong", points)))
    assert rows[0].state == "failed" and "no metrics" in rows[0].error
    assert rows[1].speedup == pytest.approx(1.0)
    assert rows[2].speedup == pytest.approx(1.8)
    assert rows[2].efficiency == pytest.approx(0.9)
    assert rows[2].predicted_comm_s is None


def test_weak_efficiency_is_per_gpu_throughput_ratio(tmp_path):
    root = tmp_path / "weak"
    for gpus, ips in ((1, 100.0), (2, 190.0), (4, 360.0)):
        write_run(root / f"g{gpus}", gpus, 16, ips, [0.01] * gpus)
    points = [{"gpus": g, "run_dir": f"g{g}"} for g in (1, 2, 4)]
    rows = scaling.scaling_table(scaling.load_study(write_study(root, "weak", points)))
    assert [r.global_batch for r in rows] == [16, 32, 64]
    assert [r.efficiency for r in rows] == pytest.approx([1.0, 0.95, 0.9])
    assert [r.speedup for r in rows] == pytest.approx([1.0, 1.9, 3.6])


def test_sweep_state_and_world_size_mismatch_are_failures(tmp_path):
    root = tmp_path / "s"
    write_run(root / "a", 2, 16, 200.0, [0.01, 0.01])
    write_run(root / "b", 2, 16, 200.0, [0.01, 0.01])
    write_run(root / "c", 1, 16, 100.0, [0.0])
    points = [
        {"gpus": 1, "run_dir": "c"},
        {"gpus": 2, "run_dir": "a", "state": "TIMEOUT"},
        {"gpus": 4, "run_dir": "b"},
    ]
    rows = scaling.scaling_table(scaling.load_study(write_study(root, "strong", points)))
    assert rows[1].state == "failed" and "TIMEOUT" in rows[1].error
    assert rows[2].state == "failed" and "ran on 2 ranks" in rows[2].error


def test_reference_figures_use_the_same_arithmetic():
    volo, deepspeed = report.references()
    assert volo["speedup"] == pytest.approx(4.2)
    assert volo["efficiency"] == pytest.approx(0.84)
    assert deepspeed["efficiency"] == pytest.approx(0.92625)
    assert scaling.speedup_efficiency(40, 2100, 8, 500) == pytest.approx((4.2, 0.84))


def test_step_line_missing_field_names_it(tmp_path):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    line = step_line(0, 1, 0, 8, (0.1, 0.1, 0.1, 0.1))
    del line["time"]["comm"]
    (run / "metrics" / "rank0.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match="comm"):
        read_run(run)


def test_study_json_unknown_key_and_bad_mode(tmp_path):
    root = write_study(tmp_path / "s", "strong", [{"gpus": 1, "run_dir": "x", "gpu": 2}])
    with pytest.raises(
        ValueError, match=r"points\[0\]: unknown key\(s\) 'gpu' \(did you mean 'gpus'\?\)"
    ):
        scaling.load_study(root)
    root = write_study(tmp_path / "t", "medium", [{"gpus": 1, "run_dir": "x"}])
    with pytest.raises(ValueError, match="mode must be one of"):
        scaling.load_study(root)


def test_html_report_is_self_contained_with_plots(strong_study):
    html_path = report.write_report(scaling.load_study(strong_study))
    html = html_path.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 4
    assert all(base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n") for data in images)
    for name in ("speedup.png", "efficiency.png", "breakdown.png", "comm.png", "table.json"):
        assert (html_path.parent / name).stat().st_size > 0
    assert "FAILED" in html and "no summary" in html
    assert "<b>This study.</b> Strong scaling: the global batch is fixed" in html
    assert "<b>For comparison.</b> Weak scaling: the batch per GPU is fixed" in html
    assert "84.0%" in html and "92.6%" in html
    assert "90.0%" in html  # the 2-GPU point's efficiency
    assert '<table id="goodput">' in html  # runs without timing records: rows of zeros
    assert not re.search(r'src="(?!data:)', html), "the report must not link external files"
    table = json.loads((html_path.parent / "table.json").read_text())
    assert [r["state"] for r in table["rows"]] == ["ok", "ok", "ok", "failed"]


def test_cli_report_prints_html_path(strong_study, capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["report", str(strong_study), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out / "report.html")


def test_cli_report_from_loose_run_dirs(tmp_path, capsys):
    write_run(tmp_path / "r1", 1, 8, 50.0, [0.0])
    write_run(tmp_path / "r2", 2, 8, 90.0, [0.01, 0.01])
    args = ["report", str(tmp_path / "r1"), str(tmp_path / "r2"), "--mode", "weak"]
    assert main([*args, "--out", str(tmp_path / "rep")]) == 0
    table = json.loads((tmp_path / "rep" / "table.json").read_text())
    assert [r["efficiency"] for r in table["rows"]] == pytest.approx([1.0, 0.9])


def test_cli_report_bad_input(tmp_path, capsys):
    assert main(["report", ""]) == 2
    assert "make report STUDY=" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_report_entry_point_runs_as_module(strong_study):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "vitpod.analysis", "report", str(strong_study)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip().splitlines()[-1]).is_file()


def test_analysis_imports_neither_workflows_nor_trainer_nor_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('torch', 'workflows', 'trainer'): sys.modules[name] = None\n"
        "import vitpod.analysis.__main__, vitpod.analysis.commcost\n"
        "import vitpod.analysis.memory, vitpod.analysis.report\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def _with_points(study_dir, **by_gpus):
    """Set fields of study.json's points: by_gpus = {field: {gpus: value}}."""
    study = json.loads((study_dir / "study.json").read_text())
    for point in study["points"]:
        for field, values in by_gpus.items():
            point[field] = values.get(point["gpus"])
    (study_dir / "study.json").write_text(json.dumps(study))


def test_predicted_step_time_is_the_baselines_scaled_and_25pct_misses_are_named(strong_study):
    _with_points(strong_study, predicted_comm_s={1: 0.0, 2: 0.020, 4: 0.001, 8: 0.001})
    rows = scaling.scaling_table(scaling.load_study(strong_study))
    g1, g2, g4, g8 = rows
    # Baseline: 65 ms a step, no comm, 32 images a rank; g2 computes 16 a rank, g4 8.
    assert g1.predicted_step_s == pytest.approx(0.065) and g1.step_error == pytest.approx(0.0)
    assert g2.predicted_step_s == pytest.approx(0.065 * 16 / 32 + 0.020)
    assert g2.step_error == pytest.approx((0.0525 - 0.085) / 0.085)
    assert g4.predicted_step_s == pytest.approx(0.065 * 8 / 32 + 0.001)
    assert g8.predicted_step_s is None  # failed: nothing measured to hold it against
    assert [r.gpus for r in scaling.off_points(rows)] == [2, 4]
    html = report.write_report(scaling.load_study(strong_study)).read_text()
    assert '<table id="prediction">' in html
    assert "The model is off by more than 25% at\n2, 4 GPU(s)." in html
    assert "-38% (off)" in html and ">+0%</td>" in html


def test_gpu_hours_per_point_in_the_report_and_report_json(strong_study):
    _with_points(strong_study, device_kind={1: "GPU", 2: "GPU", 4: "GPU", 8: "GPU"},
                 device_hours={1: 0.5, 2: 1.0, 4: 2.0, 8: 4.0},
                 useful_device_hours={1: 0.25, 2: 0.5, 4: 1.0, 8: 0.0})  # fmt: skip
    rows = scaling.scaling_table(scaling.load_study(strong_study))
    assert [r.device_hours for r in rows] == [0.5, 1.0, 2.0, 4.0]  # the failed point's too
    html = report.write_report(scaling.load_study(strong_study)).read_text()
    assert "In all: 7.5 GPU-hours allocated, 1.75 useful." in html
    assert "<th>GPU-hours</th>" in html and "<td>4</td>" in html
    record = json.loads((strong_study / "report.json").read_text())
    assert record["device_kind"] == "GPU" and record["device_hours"] == pytest.approx(7.5)
    assert record["useful_device_hours"] == pytest.approx(1.75)
    assert [p["device_hours"] for p in record["points"]] == [0.5, 1.0, 2.0, 4.0]


def test_without_accounting_gpu_hours_are_na_and_loose_runs_write_no_report_json(tmp_path):
    root = tmp_path / "pipeline"
    write_run(root / "r1", 1, 32, 100.0, [0.0])
    write_run(root / "r2", 2, 16, 180.0, [0.01, 0.01])
    (root / "report.json").write_text("{}")  # a pipeline's own report: left alone
    html = report.write_report(scaling.study_from_runs([root / "r1", root / "r2"], "strong"))
    assert "In all: n/a." in html.read_text()
    assert (root / "report.json").read_text() == "{}"
