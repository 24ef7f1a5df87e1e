"""--checkpoint-every auto (issue 32, item 2): the planner's interval sqrt(2 x C x M) (Young 1974,
Daly 2006) in steps, from the last run's measured save cost and step time and the partition's
sacct interruptions, each with its fallback; recorded in plan.json. Fake run directories and a
fake sacct; the live case is tests/test_checkpoint_interval_slurm.py."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml

from vitpod.registry import runfiles
from vitpod.registry.decision import read_decision, write_decision
from vitpod.trainer.config import ConfigError as TrainerConfigError
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.settings.flags import parse_args
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.planning import ckptinterval, interruptions
from vitpod.workflows.planning.interruptions import History, HistoryError, partition_history
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.site.profile import PROFILE_DIR, bundled_profiles, load_profile

SACCT = (
    "101|COMPLETED|7200\n"
    "102|REQUEUED|1800\n"  # a requeued start (-D), then the start that completed
    "102|COMPLETED|5400\n"
    "103|PREEMPTED|3600\n"
    "104|NODE_FAIL|600\n"
    "105|CANCELLED by 0|0\n"
    "106_3|TIMEOUT|3600\n"
)


def _sacct(stdout: str = SACCT, rc: int = 0, calls: list | None = None):
    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        if calls is not None:
            calls.append(cmd)
        err = "sacct: error: no database" if rc else ""
        return subprocess.CompletedProcess(cmd, rc, stdout, err)

    return run


def _profile(tmp_path: Path, **blocks: dict) -> str:
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    for key, value in blocks.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _run(root: Path, name: str, img: int, records: list[dict], model: str = "volo_tiny") -> Path:
    """A finished run: its config.json and rank 0's metrics records."""
    run = root / name
    (run / runfiles.METRICS).mkdir(parents=True)
    config = {"model": model, "img_size": img, "batch_size": 16}
    (run / runfiles.CONFIG).write_text(json.dumps(config))
    lines = "".join(json.dumps(r) + "\n" for r in records)
    runfiles.metrics_file(run, 0).write_text(lines + '{"kind": "step", "trunc')  # being written
    return run


def _step(step: int, seconds: float, wait: float = 0.0, warmup: bool = False) -> dict:
    return {"kind": "step", "step": step, "warmup": warmup,
            "time": {"step": seconds, "checkpoint_wait": wait}}  # fmt: skip


def _save(step: int, seconds: float) -> dict:
    return {"kind": "timing", "event": "checkpoint", "step": step, "seconds": seconds}


def _plan(tmp_path: Path, args: str = "--checkpoint-every auto", cluster: str = "", **req):
    return plan_job(Request(cluster=cluster or _profile(tmp_path), model="volo_tiny",
                            run_root=str(tmp_path / "runs"), args=args, **req))  # fmt: skip


def test_young_daly_interval_and_its_steps():
    assert ckptinterval.young_daly_s(10.0, 3600.0) == pytest.approx(math.sqrt(72000))  # 268.3 s
    assert ckptinterval.young_daly_s(2.0, 8 * 3600.0) == pytest.approx(339.41, abs=0.01)
    assert ckptinterval.interval_steps(268.33, 0.5) == 537
    assert ckptinterval.interval_steps(0.2, 0.5) == 1  # a save at least every step
    assert ckptinterval.interval_steps(268.33, None) == 0  # unknown step time: epoch ends


def test_sacct_history_counts_preempted_node_failed_and_requeued_starts_per_job_hour(
    monkeypatch,
):
    calls: list = []
    monkeypatch.setattr(slurm, "runner", _sacct(calls=calls))
    found = partition_history("gpu")
    cmd = calls[0]
    assert cmd[:2] == ["sacct", "-X"] and "-D" in cmd, cmd  # requeued starts listed
    assert cmd[cmd.index("--partition") + 1] == "gpu" and "now-30days" in cmd, cmd
    assert found.starts == 7 and found.interruptions == 3
    assert found.job_hours == pytest.approx(22200 / 3600)
    assert found.mtbi_hours == pytest.approx(22200 / 3600 / 3)
    assert "3 interruption(s) in 6.17 job-hours of 7 start(s) on partition gpu" in found.source()
    monkeypatch.setattr(slurm, "runner", _sacct(rc=1))
    with pytest.raises(HistoryError, match=r"failed \(exit 1: sacct: error: no database\)"):
        partition_history("gpu")


def test_auto_from_the_last_matching_runs_save_and_step_time_and_the_partitions_history(
    tmp_path, monkeypatch
):
    """C: the median blocking save of the newest run of the same model, img size and batch
    (its checkpoint span plus the next step's checkpoint_wait); the step time: its median
    (warm-up left out); M: sacct's job-hours per interruption. plan.json's trainer section
    holds --checkpoint-every round(sqrt(2CM) / step) (no token is added to the command), and
    the record says how it was found."""
    root = tmp_path / "runs"
    steps = [_step(1, 9.0, warmup=True), _step(2, 0.4), _step(3, 0.5, wait=0.25), _step(4, 0.6),
             _step(5, 0.5), _step(6, 0.4, wait=0.5)]  # fmt: skip
    match = _run(root, "20240101T000000Z-volo_tiny-pretrain-aaaaaa", 32,
                 [*steps, _save(2, 1.0), _save(5, 2.0), _save(6, 9.0)])  # fmt: skip
    _run(root, "20240301T000000Z-volo_tiny-finetune-bbbbbb", 64, [_step(2, 5.0), _save(2, 50.0)])
    _run(root, "20240401T000000Z-volo_d1-pretrain-cccccc", 32, [_step(2, 7.0), _save(2, 70.0)],
         model="volo_d1")  # fmt: skip
    monkeypatch.setattr(ckptinterval, "partition_history",
                        lambda part: History(part, 30, 40, 12.0, 4))  # fmt: skip
    plan = _plan(tmp_path)
    record = plan.decision.checkpoint
    cost = 2.0 + 0.5  # median of 1.0 + 0.25 (step 3's wait), 2.0 + 0.5 (step 6's), 9.0
    assert record.save_cost_s == pytest.approx(cost), record
    assert record.save_cost_source == f"median blocking save of 3 in {match}"
    assert record.mtbi_hours == 3.0 and record.interruptions == 4 and record.job_hours == 12.0
    assert record.mtbi_source.startswith("sacct: 4 interruption(s) in 12.00 job-hours")
    assert record.step_time_s == 0.5 and str(match) in record.step_time_source
    interval = math.sqrt(2 * cost * 3.0 * 3600)
    assert record.interval_s == pytest.approx(interval)
    assert record.steps == round(interval / 0.5) == 465
    assert plan.trainer["checkpoint_every"] == 465
    assert plan.spec.command[-2:] == ("--checkpoint-every", "auto")  # ARGS, as given
    write_decision(tmp_path, plan.decision)
    assert read_decision(tmp_path).checkpoint == record


def test_without_runs_or_history_the_profile_values_and_epoch_ends(tmp_path, monkeypatch):
    """No run measured a save or a step: the profile's checkpoint.save_cost_s (default 10 s)
    and, sacct counting no interruption, preemption.mtbi_hours; the step time is recorded as
    unknown and the ranks checkpoint at epoch ends (0)."""
    monkeypatch.setattr(ckptinterval, "partition_history",
                        lambda part: History(part, 30, 5, 3.0, 0))  # fmt: skip
    profile = _profile(tmp_path, preemption={"mtbi_hours": 6.0})
    record = _plan(tmp_path, cluster=profile).decision.checkpoint
    assert record.save_cost_s == 10.0
    assert "save_cost_s (default); no run of volo_tiny at 32 px" in record.save_cost_source
    assert record.mtbi_hours == 6.0 and record.interruptions == 0
    assert "preemption.mtbi_hours; sacct: 0 interruption(s)" in record.mtbi_source
    assert "none to divide by" in record.mtbi_source
    assert record.step_time_s is None and record.step_time_source.startswith("unknown")
    assert record.interval_s == pytest.approx(math.sqrt(2 * 10.0 * 6 * 3600))
    assert record.steps == 0 and "epoch ends" in record.line()


def test_sacct_failing_or_offline_falls_back_to_the_profiles_mtbi(tmp_path, monkeypatch):
    def broken(part: str) -> History:
        raise HistoryError(["sacct"], None, "", "could not run (No such file or directory)")

    monkeypatch.setattr(ckptinterval, "partition_history", broken)
    record = _plan(tmp_path).decision.checkpoint
    assert record.mtbi_hours == 24.0 and record.interruptions is None
    assert record.mtbi_source == ("profile localslurm's preemption.mtbi_hours (default); `sacct` "
                                  "could not run (No such file or directory)")  # fmt: skip

    def never(part: str) -> History:
        raise AssertionError("OFFLINE asks Slurm nothing")

    monkeypatch.setattr(ckptinterval, "partition_history", never)
    record = _plan(tmp_path, offline=True).decision.checkpoint
    assert record.mtbi_source.endswith("(default); offline: Slurm not asked")
    record = _plan(tmp_path, cluster="local").decision.checkpoint
    assert record.mtbi_source.endswith("(default); no Slurm")


def test_a_number_in_args_wins_over_the_profiles_auto_and_a_profile_number_is_passed(tmp_path):
    auto = _profile(tmp_path, checkpoint={"every": "auto"})
    plan = _plan(tmp_path, args="--checkpoint-every 7", cluster=auto)
    assert plan.decision.checkpoint is None and plan.trainer["checkpoint_every"] == 7
    assert plan.spec.command[-2:] == ("--checkpoint-every", "7")  # ARGS only, nothing added
    plan = _plan(tmp_path, args="", cluster=_profile(tmp_path, checkpoint={"every": 25}))
    assert plan.decision.checkpoint is None and plan.trainer["checkpoint_every"] == 25
    assert "--checkpoint-every" not in plan.spec.command  # the profile's value: a field
    plan = _plan(tmp_path, args="", cluster=_profile(tmp_path, checkpoint={}))
    assert plan.trainer["checkpoint_every"] == 500  # unset: the trainer's default
    assert "--checkpoint-every" not in plan.spec.command


def test_production_profiles_default_to_auto_and_the_local_ones_keep_the_trainers_default():
    every = {name: load_profile(name).checkpoint.every for name in bundled_profiles()}
    assert {n for n, v in every.items() if v == "auto"} == {"dgxpod", "h100pod", "superpod"}
    assert {v for n, v in every.items() if n.startswith("local")} == {None}


def test_a_bad_checkpoint_every_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"field checkpoint\.every"):
        load_profile(_profile(tmp_path, checkpoint={"every": "often"}))
    with pytest.raises(ConfigError, match=r"--checkpoint-every: 'often': give a number of steps"):
        _plan(tmp_path, args="--checkpoint-every often")


def test_a_hand_started_trainer_refuses_auto_with_the_fix():
    cfg = parse_args(["--dataset", "synthetic", "--checkpoint-every", "auto"])
    found = [p for p in problems(cfg) if p.startswith("--checkpoint-every auto")]
    assert found and "give --checkpoint-every N (steps) or 0 (epoch ends)" in found[0], found
    assert not [p for p in problems(cfg, for_training=False) if "checkpoint" in p]  # planner
    with pytest.raises(TrainerConfigError, match="only the planner resolves it"):
        cfg.checkpoint_steps  # noqa: B018


def test_the_history_query_is_one_function_in_one_module():
    """The history query is one function, and it runs sacct through the one Slurm client
    (workflows/slurm) that the goodput ledger uses too."""
    source = Path(interruptions.__file__).read_text()
    assert source.count('slurm.run(["sacct"') == 1 and "subprocess" not in source
    assert '"sacct"' not in Path(ckptinterval.__file__).read_text()


def test_expected_lost_work_against_the_ledgers_in_status_and_report(tmp_path):
    """Half an interval per restart without warning (the interval the ranks run: steps x step
    time), shown under the goodput line and in report.json beside the ledger's lost seconds."""
    from vitpod.analysis.goodput import Ledger
    from vitpod.registry.decision import CheckpointInterval
    from vitpod.workflows.watching import status

    record = CheckpointInterval(
        save_cost_s=10.0, save_cost_source="test", mtbi_hours=2.0, mtbi_source="test",
        step_time_s=0.5, step_time_source="test", interval_s=379.5, steps=700,
    )  # fmt: skip
    assert record.expected_lost_s(0) == 0.0
    assert record.expected_lost_s(2) == pytest.approx(2 * 700 * 0.5 / 2)  # the steps it runs
    epoch_ends = record.model_copy(update={"steps": 0})
    assert epoch_ends.expected_lost_s(1) == pytest.approx(379.5 / 2)

    plan = _plan(tmp_path)
    run = Path(plan.spec.run_dir)
    run.mkdir(parents=True)
    decision = plan.decision.model_copy(update={"checkpoint": record})
    write_decision(run, decision)
    ledger = Ledger(wall=900.0, attempts=3)
    ledger.parts["lost"] = 42.0
    shown = status.format_status(
        [
            JobState("pretrain", run, ["1"], state="COMPLETED", restarts=2, step=10, ledger=ledger)
        ]  # fmt: skip
    )
    assert "checkpoint interval: expected lost <= 350.0 s (2 restart(s)" in shown, shown
    assert shown.rstrip().endswith("lost 42.0 s"), shown
    report = status.stage_report({"run_dir": str(run), "job_ids": ["1"]}, "COMPLETED", ledger)
    assert report["checkpoint_interval"] == {
        "steps": 700, "restarts": 2, "expected_lost_s": 350.0, "lost_s": 42.0
    }  # fmt: skip
