"""`make status` on a real run of the `local` profile (the demo's kind of run: no Slurm, no
accounting): the snapshot line shows step/total, loss, images/s, ETA, engine and checkpoint age,
and the goodput ledger is the run's own wall and training time (issue 28 item 6)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import vitpod
from vitpod.registry import runfiles
from vitpod.registry.decision import read_decision
from vitpod.workflows.pipeline.chain import Chain
from vitpod.workflows.site.profile import PROFILE_DIR
from vitpod.workflows.watching import status

STEPS = 8
ARGS = (f"--max-steps {STEPS} --epochs 1 --workers 0 --loader torch --log-interval 1 -b 8 "
        "--checkpoint-every 4")  # fmt: skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> Path:
    """A finished pretrain on the bundled local profile (2 gloo ranks): the pipeline dir."""
    tmp = tmp_path_factory.mktemp("local-run")
    data = yaml.safe_load((PROFILE_DIR / "local.yaml").read_text())
    data["storage"] = {"data": str(digits_dir.parent)}
    profile = tmp / "local.yaml"
    profile.write_text(yaml.safe_dump(data))
    run = Chain(str(profile), "volo_tiny", args=ARGS, stages=("pretrain",),
                run_root=str(tmp / "runs")).submit()  # fmt: skip
    report = run.wait(timeout=600, poll_s=1)
    assert report["stages"]["pretrain"]["state"] == "COMPLETED"
    assert run.directory is not None
    return run.directory


def _rank0(run_dir: Path) -> list[dict]:
    return runfiles.read_metrics(run_dir, 0)


def _status_cli(run: Path) -> str:
    out = vitpod("status", "--run", str(run), timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _seconds(text: str) -> int:
    parts = [int(p) for p in text.split(":")]
    return sum(p * 60**i for i, p in enumerate(reversed(parts)))


def test_snapshot_shows_step_loss_speed_eta_engine_and_checkpoint_age(local_run: Path) -> None:
    run_dir = local_run / "pretrain"
    shown_at = time.time()
    line = _status_cli(local_run).splitlines()[0]
    fields = dict(re.findall(r"(\S+?)=(\S+)", line))
    steps = [r for r in _rank0(run_dir) if r.get("kind") == "step"]
    # step/total: the last step of the planned total; loss: rank 0's newest step's loss
    assert fields["step"] == f"{STEPS}/{STEPS}"
    assert float(fields["loss"]) == pytest.approx(steps[-1]["loss"], abs=1e-4)
    assert 0 < float(fields["loss"]) < 10  # cross-entropy over 10 classes, from ~2.3
    summary = json.loads((run_dir / runfiles.SUMMARY).read_text())
    assert float(fields["images/s"]) == pytest.approx(summary["images_per_s"], abs=0.1)
    assert float(fields["images/s"]) > 0
    assert fields["ETA"] == "0:00"  # finished
    assert fields["engine"] == read_decision(run_dir).engine.name == "ring"
    commits = list((run_dir / runfiles.CHECKPOINTS).glob(f"*/{runfiles.CHECKPOINT_COMMIT}"))
    assert len(commits) >= 2  # steps 4 and 8
    age = shown_at - max(p.stat().st_mtime for p in commits)
    assert abs(_seconds(fields["ckpt_age"]) - age) <= 5
    # --json carries the same facts
    shown = json.loads(json.dumps(status.as_dict(status.run_status(local_run)[0])))
    assert (shown["last_step"], shown["total_steps"], shown["engine"]) == (STEPS, STEPS, "ring")
    assert shown["loss"] is not None and shown["eta_s"] == 0.0 and shown["ckpt_age_s"] is not None
    assert shown["ledger"]["wall"] > 0


def test_goodput_without_accounting_is_the_runs_own_wall_and_training_time(
    local_run: Path,
) -> None:
    run_dir = local_run / "pretrain"
    records = _rank0(run_dir)
    start = next(r for r in records if r.get("event") == "start")
    end = next(r for r in records if r.get("event") == "end")
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("event") == "eval"]
    ledger = status.run_status(local_run)[0].ledger
    assert ledger is not None
    # wall: from the process's start to its last record; training: the kept steps after the
    # first (start-up), less checkpoint waits
    assert ledger.wall == pytest.approx(end["wall_time"] - start["process_start"], abs=0.01)
    kept = sum(s["time"]["step"] - s["time"]["checkpoint_wait"] for s in steps[1:])
    assert ledger.parts["training"] == pytest.approx(kept, rel=1e-6) and kept > 0
    assert ledger.parts["eval"] == pytest.approx(sum(e["seconds"] for e in evals))
    assert ledger.parts["startup"] == pytest.approx(steps[0]["wall_time"] - start["process_start"])
    assert 0 <= ledger.other < 0.2 * ledger.wall
    assert ledger.ranks == [2]
    printed = _status_cli(local_run)
    assert f"goodput: wall={ledger.wall:.1f}s" in printed and "training=" in printed
    # report.json's goodput (per stage and summed)
    record = json.loads((local_run / runfiles.PIPELINE).read_text())
    report = status.pipeline_report(local_run, record)
    assert report["stages"]["pretrain"]["goodput"]["parts"]["training"] == pytest.approx(kept)
    assert report["goodput"]["wall"] == pytest.approx(ledger.wall)
