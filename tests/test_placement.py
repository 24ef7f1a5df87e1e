"""Placement by predicted finish (workflows/planning/placement.py) against fake Slurm answers: the
table, the choice, DEADLINE, the step-time model and plan.json's record. No Slurm is run: the
client's runner (workflows/slurm.runner) answers `sbatch --test-only` per node count and sacct with
nothing. The live test is tests/test_placement_slurm.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import make
from vitpod.analysis.goodput import Ledger
from vitpod.analysis.layout import step_flops
from vitpod.registry.decision import read_decision
from vitpod.workflows import cli, slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.pipeline.chain_stage import job_plan
from vitpod.workflows.planning import placement, steptime
from vitpod.workflows.planning.plan import Request
from vitpod.workflows.site.profile import PROFILE_DIR

NOW = dt.datetime(2030, 1, 1, 12, 0, 0).astimezone()
ARGS = "-b 8 --max-steps 100 --checkpoint-every 0 --workers 0"
STEP_S, COMM_S = 0.4, 0.05  # the earlier run's median step and comm on 1 node (2 ranks, accum 2)


@pytest.fixture
def ranged(tmp_path: Path) -> Path:
    """localslurm with `nodes: 1-2` (2 ranks a node)."""
    profile = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    profile["nodes"] = "1-2"
    path = tmp_path / "ranged.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def fake_slurm(monkeypatch: pytest.MonkeyPatch, wait_for_two: float) -> list[str]:
    """sbatch --test-only: 1 node starts at NOW, 2 nodes `wait_for_two` s later; sacct: nothing.
    Returns the scripts --test-only was asked about."""
    asked: list[str] = []

    def runner(argv, *, timeout, input=None, cwd=None):
        if argv[:2] == ["sbatch", "--test-only"]:
            asked.append(input)
            nodes = int(re.search(r"^#SBATCH --nodes=(\S+)$", input, re.M)[1])
            start = NOW + dt.timedelta(seconds=wait_for_two if nodes == 2 else 0)
            when = start.strftime("%Y-%m-%dT%H:%M:%S")
            said = (f"sbatch: Job 99 to start at {when} using {2 * nodes} processors on nodes "
                    f"node[1-{nodes}] in partition pretrain\n")  # fmt: skip
            return subprocess.CompletedProcess(argv, 0, "", said)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(slurm, "runner", runner)
    return asked


def earlier_run(root: Path, name: str, model: str = "volo_tiny", world: int = 2, accum: int = 2,
                step_s: float = STEP_S, comm_s: float = COMM_S,
                device: str = "cpu") -> Path:  # fmt: skip
    """A finished run beside the new one: config.json and rank 0's records (the start-up `mfu`
    record naming what the steps ran on, the steps)."""
    run = root / name
    (run / "metrics").mkdir(parents=True)
    config = {"model": model, "img_size": 32, "batch_size": 8, "accum_steps": accum,
              "world_size": world, "epochs": 1, "max_steps": 10, "data_dir": "x"}  # fmt: skip
    (run / "config.json").write_text(json.dumps(config))
    records = [{"kind": "timing", "event": "start", "step": 0, "wall_time": 1000.0,
                "process_start": 990.0, "job_id": "1", "restart": 0},
               {"kind": "mfu", "device": device}]  # fmt: skip
    for step in range(1, 11):
        records.append({"kind": "step", "step": step, "world_size": world, "warmup": step < 3,
                        "total_steps": 10, "wall_time": 1000.0 + 10 + step * step_s,
                        "time": {"step": step_s, "comm": comm_s}})  # fmt: skip
    (run / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def request(profile: Path, root: Path, args: str = ARGS) -> Request:
    return Request(cluster=str(profile), model="volo_tiny", args=args, run_root=str(root))


def test_one_node_now_beats_two_nodes_later_and_plan_json_records_both(
    ranged, tmp_path, monkeypatch
):
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    asked = fake_slurm(monkeypatch, wait_for_two=3600)
    plan = placement.place(request(ranged, root), start_of=placement.slurm_start)
    record = plan.decision.placement
    assert [c.nodes for c in record.candidates] == [1, 2]
    assert len(asked) == 2 and "#SBATCH --nodes=1\n" in asked[0] and "--nodes=2\n" in asked[1]
    one, two = record.candidates
    assert one.start == NOW.isoformat() and two.start == (NOW + dt.timedelta(hours=1)).isoformat()
    assert one.step_time_s == pytest.approx(STEP_S)  # measured on this very layout
    assert record.rule == "earliest finish" and record.chosen == 0 and plan.spec.nodes == 1
    assert (plan.trainer["global_batch"], plan.trainer["elastic"]) == (32, True)  # range's batch
    assert one.device_kind == "CPU" and one.device_hours == pytest.approx(2 * one.run_s / 3600)


def test_with_both_free_two_nodes_finish_first(ranged, tmp_path, monkeypatch):
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    fake_slurm(monkeypatch, wait_for_two=0)
    plan = placement.place(request(ranged, root))
    record = plan.decision.placement
    two = record.candidates[1]
    # 1 node measured 0.4 s a step with 2 micro-batches; 2 nodes take 1: (0.4 - 0.05) / 2 + comm
    comm = plan.decision.costs.predicted_comm_s
    assert two.step_time_s == pytest.approx((STEP_S - COMM_S) / 2 + comm)
    assert "compute scaled to 1 micro-batch(es)" in two.step_time_source
    assert record.chosen == 1 and plan.spec.nodes == 2 and plan.spec.nodes_max is None
    assert two.finish < record.candidates[0].finish


def test_deadline_takes_the_fewest_cpu_hours_that_finish_by_it(ranged, tmp_path, monkeypatch):
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    fake_slurm(monkeypatch, wait_for_two=0)
    deadline = (NOW + dt.timedelta(days=1)).isoformat()
    record = placement.place(request(ranged, root), deadline).decision.placement
    one, two = record.candidates
    assert two.finish < one.finish and one.device_hours < two.device_hours
    assert record.chosen == 0 and record.rule == "fewest CPU-hours by DEADLINE"
    assert one.within_deadline is two.within_deadline is True


def test_a_deadline_nobody_meets_is_refused_naming_the_earliest(ranged, tmp_path, monkeypatch):
    earlier_run(tmp_path / "runs", "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    fake_slurm(monkeypatch, wait_for_two=0)
    with pytest.raises(ConfigError, match=r"DEADLINE=.*no candidate finishes by then; the "
                       r"earliest is 2 node\(s\)"):  # fmt: skip
        placement.place(request(ranged, tmp_path / "runs"), "2000-01-01T00:00")


@pytest.mark.parametrize("bad", ["tomorrow", "6 hours", "2030-13-01", "-5m"])
def test_a_bad_deadline_is_refused_naming_the_variable_and_format(bad):
    with pytest.raises(ConfigError, match=rf"DEADLINE={re.escape(repr(bad))}: write an ISO "
                       r"time .* or a duration from now \(90m, 6h, 2d\)"):  # fmt: skip
        placement.parse_deadline(bad)


def test_deadline_takes_durations_and_iso_times():
    assert placement.parse_deadline("90m", NOW) == NOW + dt.timedelta(minutes=90)
    assert placement.parse_deadline("2d", NOW) == NOW + dt.timedelta(days=2)
    aware = placement.parse_deadline("2030-01-02T06:00+02:00")
    assert aware.utcoffset() == dt.timedelta(hours=2)
    assert placement.parse_deadline("2030-01-02T06:00").tzinfo is not None  # local time
    assert placement.parse_deadline("  ") is None


def test_without_a_run_of_the_model_the_flops_of_a_step_at_a_measured_rate(
    ranged, tmp_path, monkeypatch
):
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-vit_micro-pretrain-aaaaaa", model="vit_micro")
    fake_slurm(monkeypatch, wait_for_two=0)
    one = placement.place(request(ranged, root)).decision.placement.candidates[0]
    rate = step_flops("vit_micro", 32, 16) / (STEP_S - COMM_S)
    assert "FLOP/s (vit_micro measured in" in one.step_time_source
    assert one.step_time_s == pytest.approx(
        step_flops("volo_tiny", 32, 16) / rate + _comm(ranged, root, monkeypatch, 1), rel=1e-6
    )


def _comm(profile: Path, root: Path, monkeypatch, nodes: int) -> float:
    from vitpod.workflows.planning.plan import plan_job

    plan = plan_job(Request(cluster=str(profile), model="volo_tiny", args=ARGS,
                            run_root=str(root), nodes=nodes))  # fmt: skip
    return plan.decision.costs.predicted_comm_s


def test_no_run_to_go_by_predicts_the_time_limit(ranged, tmp_path, monkeypatch):
    fake_slurm(monkeypatch, wait_for_two=0)
    one = placement.place(request(ranged, tmp_path / "runs")).decision.placement.candidates[0]
    assert one.step_time_s is None and one.run_s == 30 * 60
    assert one.run_source.startswith("the time limit 00:30:00: no earlier run on cpu measured")


def test_make_place_prints_the_table_and_ends_with_the_script_path(
    ranged, tmp_path, monkeypatch, capsys
):
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    fake_slurm(monkeypatch, wait_for_two=3600)
    argv = ["--cluster", str(ranged), "--model", "volo_tiny", "--args", ARGS,
            "--run-root", str(root)]  # fmt: skip
    assert cli.main(["place", *argv]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    script = Path(lines[-1])
    assert (
        script.name == "job.sbatch"
        and script.is_file()
        and "#SBATCH --nodes=1\n" in (script.read_text())
    )
    assert "placement: earliest finish" in out and "placed: 1 node(s) on pretrain" in out
    assert re.search(r"\*\s*│\s*pretrain\s*│\s*default\s*│\s*1\s*│", out)  # the chosen row
    record = read_decision(script.parent).placement
    assert record is not None and record.prediction.nodes == 1 and len(record.candidates) == 2


def test_submit_refuses_a_deadline_without_place(ranged, tmp_path, capsys):
    argv = ["submit", "--cluster", str(ranged), "--deadline", "6h", "--dry-run"]
    assert cli.main(argv) == 2
    assert "DEADLINE='6h' chooses among placement candidates; add PLACE=1" in (
        capsys.readouterr().err
    )


def test_offline_ranks_by_the_step_model_alone_and_says_the_starts_are_unknown(
    tmp_path, monkeypatch
):
    """dgxpod's pretrain partition has 5 nodes (max_nodes): 1 to 5 are candidates; OFFLINE=1
    asks Slurm nothing, so with an earlier run the shortest predicted run wins."""
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_d5-pretrain-aaaaaa", model="volo_d5", world=8,
                accum=1, step_s=2.0, comm_s=0.1, device="NVIDIA A100-SXM4-80GB")  # fmt: skip
    asked = fake_slurm(monkeypatch, wait_for_two=0)
    req = Request(cluster="dgxpod", model="volo_d5", offline=True, run_root=str(root),
                  args="--img-size 32 -b 8 --max-steps 100 --checkpoint-every 0 --epochs 1 "
                  "--token-label-size 2 --warmup-epochs 0")  # fmt: skip
    record = placement.place(req).decision.placement
    assert asked == [] and record.starts_known is False
    assert [c.nodes for c in record.candidates] == [1, 2, 3, 4, 5]
    runs = [c.run_s for c in record.candidates]
    assert record.chosen == runs.index(min(runs)) and "start times unknown" in record.rule
    assert len({c.start for c in record.candidates}) == 1  # not asked: one "now" for all
    assert record.candidates[0].step_time_s == pytest.approx(2.0)  # measured on an A100
    assert record.note == "measured on A100"
    placement.print_placement(record)


def test_make_place_offline_is_passed_and_prints_unknown_starts(tmp_path):
    done = make("place", "CLUSTER=dgxpod", "MODEL=volo_d5", "OFFLINE=1", runs=tmp_path / "runs")
    assert done.returncode == 0, done.stderr
    assert "start and finish unknown (offline: Slurm not asked" in done.stdout
    assert "step s: estimated from FLOPs (no earlier run on A100)" in done.stdout
    assert "assumed MFU 0.064" in done.stdout
    assert Path(done.stdout.strip().splitlines()[-1]).is_file()


def test_place_refuses_a_profile_without_scheduler(tmp_path):
    with pytest.raises(ConfigError, match="profile local has no scheduler"):
        placement.place(Request(cluster="local", run_root=str(tmp_path)))


def test_status_line_puts_the_prediction_against_the_accounting(ranged, tmp_path, monkeypatch):
    fake_slurm(monkeypatch, wait_for_two=0)
    record = placement.place(request(ranged, tmp_path / "runs")).decision.placement
    chosen = record.prediction
    start = dt.datetime.fromisoformat(chosen.start).timestamp() + 30
    assert "not started yet" in record.against(None, None)
    assert "still running" in record.against(start, None)
    line = record.against(start, start + chosen.run_s + 60)
    assert f"run predicted {chosen.run_s:.0f} s, actual {chosen.run_s + 60:.0f} s" in line
    assert "(error +90 s" in line and "(+30 s)" in line
    compared = record.compared(start, start + chosen.run_s + 60)  # report.json's placement
    assert compared["run_s"] == pytest.approx(chosen.run_s + 60)
    assert compared["finish_error_s"] == pytest.approx(90) and compared["nodes"] == chosen.nodes
    assert record.compared(None, None)["finish_error_s"] is None


def test_ledger_keeps_the_first_start_and_the_last_end_open_while_one_runs():
    total = Ledger()
    total.add(Ledger(attempts=1, start=100.0, end=200.0))
    total.add(Ledger(attempts=1, start=250.0, end=400.0))
    assert (total.start, total.end) == (100.0, 400.0)
    total.add(Ledger(attempts=1, start=450.0, end=None))  # requeued, running
    assert (total.start, total.end) == (100.0, None)


def test_chain_places_its_first_stage_and_refuses_a_deadline_without_place(
    ranged, tmp_path, monkeypatch, capsys
):
    from vitpod.workflows.pipeline.chain import Chain

    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    fake_slurm(monkeypatch, wait_for_two=3600)
    monkeypatch.setattr("vitpod.workflows.pipeline.chain.preflight.check", lambda *a, **k: [])
    chain = Chain(str(ranged), "volo_tiny", args=ARGS, run_root=str(root), place=True)
    stages = chain.plan()
    pretrain, finetune = (job_plan(stages[s]) for s in ("pretrain", "finetune"))
    assert pretrain.decision.placement.prediction.nodes == 1 and pretrain.spec.nodes == 1
    assert finetune.decision.placement is None  # it waits for the pretrain: not placed
    assert "placed: 1 node(s) on pretrain" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="deadline='6h' chooses among placement candidates"):
        Chain(str(ranged), deadline="6h")
    with pytest.raises(ConfigError, match="DEADLINE='soon'"):
        Chain(str(ranged), place=True, deadline="soon")


@pytest.mark.parametrize(
    ("target", "extra", "words"),
    [("place", "DEADLINE=tomorrow", "DEADLINE='tomorrow': write an ISO time"),
     ("pretrain", "DEADLINE=6h", "DEADLINE='6h' chooses among placement candidates; add PLACE=1")],
)  # fmt: skip
def test_make_refuses_a_bad_deadline_before_asking_slurm(tmp_path, target, extra, words):
    done = make(target, "CLUSTER=localslurm", extra, runs=tmp_path / "runs", timeout=120)
    assert done.returncode != 0 and words in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()


def test_without_max_steps_the_steps_come_from_an_earlier_epoch_over_the_same_data(
    ranged, tmp_path, monkeypatch
):
    root = tmp_path / "runs"
    run = earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    fake_slurm(monkeypatch, wait_for_two=0)
    args = "-b 8 --epochs 3 --checkpoint-every 0 --workers 0"
    data = placement.plan_job(request(ranged, root, args)).trainer["data_dir"]
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "data_dir": data, "max_steps": None}))
    one, two = placement.place(request(ranged, root, args)).decision.placement.candidates
    # 10 steps of 8 x 2 x 2 = 32 images in its 1 epoch; 3 epochs at this global batch of 32
    assert one.steps == two.steps == 30
    assert "3 epoch(s) of the data" in one.run_source


def test_make_status_shows_the_placement_under_the_goodput_line(ranged, tmp_path, monkeypatch):
    from vitpod.workflows.submit.submission import materialize
    from vitpod.workflows.watching import status

    fake_slurm(monkeypatch, wait_for_two=0)
    plan = placement.place(request(ranged, tmp_path / "runs"))
    materialize(plan)
    start = dt.datetime.fromisoformat(plan.decision.placement.prediction.start).timestamp()
    ledger = Ledger(attempts=1, start=start, end=start + 100.0)
    row = JobState("pretrain", plan.run_dir, ["99"], state="COMPLETED", step=20, ledger=ledger)
    lines = status.format_status([row]).splitlines()
    assert lines[1].strip().startswith("goodput:")
    assert lines[2].strip().startswith("placement (1 node(s) on pretrain): start predicted")
    assert "actual 100 s" in lines[2]


def test_candidates_slurm_would_start_at_once_share_one_start(ranged, tmp_path, monkeypatch):
    """Asked seconds apart, each hears "now"; the later asked must not finish later for it."""
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa")
    heard: list[dt.datetime] = []

    def now_as_slurm_says(plan):
        if heard:
            time.sleep(1.5)  # a slow controller: the second "now" is later
        heard.append(dt.datetime.now().astimezone().replace(microsecond=0))
        return heard[-1]

    record = placement.place(request(ranged, root), start_of=now_as_slurm_says).decision.placement
    one, two = record.candidates
    assert heard[1] > heard[0] and one.start == two.start
    assert dt.datetime.fromisoformat(one.start) <= heard[0] + dt.timedelta(seconds=1)


D5_ARGS = "--checkpoint-every 0 --epochs 300 --warmup-epochs 0"


def imagenet_like(tmp_path: Path, images: int) -> str:
    """dgxpod with its data set at a folder of `images` (empty) JPEG files in 4 classes."""
    data = tmp_path / "imagenet"
    for i in range(images):
        folder = data / "train" / f"n{i % 4:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.JPEG").touch()
    (data / "train" / "n00000000").mkdir(parents=True, exist_ok=True)
    (data / "train" / "n00000000" / "README.txt").touch()  # not an image: not counted
    (data / "val").mkdir()
    profile = yaml.safe_load((PROFILE_DIR / "dgxpod.yaml").read_text())
    profile["storage"]["data"] = str(data)
    profile["container"]["mounts"].append({"src": str(data), "dst": str(data)})
    path = tmp_path / "dgxpod-here.yaml"
    path.write_text(yaml.safe_dump(profile))
    return str(path)


def test_gpu_kinds_match_however_the_name_is_written():
    from vitpod.registry import gpus

    assert gpus.kind("A100-SXM4-80GB") == gpus.kind("NVIDIA A100-SXM4-80GB") == "A100"
    assert gpus.kind("H100-PCIe-80GB") == gpus.kind("NVIDIA H100 PCIe") == "H100 PCIe"
    assert gpus.kind("NVIDIA H100 80GB HBM3") == "H100" and gpus.kind("cpu") == "cpu"
    assert gpus.kind("Tesla T4") == "T4" and gpus.peak_of("Tesla T4") is None
    assert gpus.peak_of("A100-SXM4-80GB").flops == 312e12


def test_without_a_run_on_the_gpu_the_step_is_estimated_from_flops_and_a_cpu_run_is_left_out(
    tmp_path,
):
    """Issue 45 (verification): a CPU volo_tiny run in the run root made dgxpod's A100 step
    1.24e4 s (the CPU's FLOP/s); now it is left out, said in the note, and the step is the
    model's FLOPs over the A100's peak x the assumed MFU, plus the predicted communication."""
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_tiny-pretrain-aaaaaa", device="cpu")
    req = Request(cluster="dgxpod", model="volo_d5", offline=True, run_root=str(root),
                  args=D5_ARGS)  # fmt: skip
    plan = placement.place(req)
    record = plan.decision.placement
    assert record.note == ("estimated from FLOPs (no earlier run on A100); left out: 1 earlier "
                           "run(s) measured on another device (cpu)")  # fmt: skip
    mfu, _ = steptime.ASSUMED_MFU["Volo"]
    for c in record.candidates:
        one = placement.plan_job(dataclasses.replace(req, nodes=c.nodes))
        comm = one.decision.costs.predicted_comm_s
        assert c.step_time_s == pytest.approx(step_flops("volo_d5", 224, 44) / (312e12 * mfu)
                                              + comm, rel=1e-9)  # fmt: skip
        assert "assumed MFU 0.064 (volo_d1 b128 bf16 eager" in c.step_time_source
    assert record.candidates[0].step_time_s < 2  # not the CPU's 1.24e4 s


def test_a_run_measured_on_another_gpu_is_left_out(tmp_path):
    root = tmp_path / "runs"
    earlier_run(root, "20000101T000000Z-volo_d5-pretrain-aaaaaa", model="volo_d5", world=8,
                accum=1, step_s=2.0, comm_s=0.1, device="NVIDIA H100 80GB HBM3")  # fmt: skip
    req = Request(cluster="dgxpod", model="volo_d5", offline=True, run_root=str(root),
                  args=D5_ARGS)  # fmt: skip
    record = placement.place(req).decision.placement
    assert "left out: 1 earlier run(s) measured on another device (H100)" in record.note
    assert record.candidates[0].step_time_s != pytest.approx(2.0)


def test_with_no_earlier_run_candidates_differ_and_a_deadline_chooses(tmp_path):
    """The steps of an epoch counted in the data set's train folder (3520 images: 10 steps an
    epoch at 1 node's global batch of 352, 2 at 5 nodes'), the step estimated from FLOPs: more
    nodes finish sooner, and DEADLINE takes the fewest GPU-hours among those done by then."""
    profile = imagenet_like(tmp_path, 3520)
    req = Request(cluster=profile, model="volo_d5", offline=True,
                  run_root=str(tmp_path / "runs"), args=D5_ARGS)  # fmt: skip
    record = placement.place(req).decision.placement
    assert [c.steps for c in record.candidates] == [3000, 1500, 1200, 900, 600]
    assert "300 epoch(s) of the 3520 images in" in record.candidates[0].run_source
    runs = [c.run_s for c in record.candidates]
    assert runs == sorted(runs, reverse=True) and record.chosen == 4  # shortest offline
    # a deadline between the 2-node and the 1-node run: 2 nodes hold the fewest GPU-hours
    deadline = f"{round((runs[0] + runs[1]) / 2 / 60)}m"
    chosen = placement.place(req, deadline).decision.placement
    assert chosen.chosen == 1 and chosen.rule == "fewest GPU-hours by DEADLINE"
    assert [c.within_deadline for c in chosen.candidates] == [False, True, True, True, True]


def test_steps_are_unknown_without_images_to_count(tmp_path):
    profile = imagenet_like(tmp_path, 0)
    req = Request(cluster=profile, model="volo_d5", offline=True,
                  run_root=str(tmp_path / "runs"), args=D5_ARGS)  # fmt: skip
    one = placement.place(req).decision.placement.candidates[0]
    assert one.steps is None and "no images found" in one.run_source
