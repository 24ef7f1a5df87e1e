"""Two real Slurm clusters under one slurmdbd (issue 33): pretrain on cluster 1, fine-tune on
cluster 2. One pipeline from `make pipeline` is preempted in its pretrain and still hands over
only at the pretrain's real end; one from Python has its final model damaged before the handover,
which is caught and starts no fine-tune."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from vitpod.registry import runfiles
from vitpod.workflows import chain_cross, jobstate
from vitpod.workflows.chain import Chain, ChainError
from vitpod.workflows.profile import PROFILE_DIR

REPO = Path(__file__).resolve().parents[1]
# Short stages (tests/test_pipeline_slurm.py's settings, capped): enough pretrain steps to
# preempt in the middle of it.
ARGS = ("--workers 0 --loader torch -b 16 --seed 3 --log-interval 5 --aa rand-n0-m0 --reprob 0 "
        "--hflip 0 --scale 1 1 --epochs 1 --warmup-epochs 0 --checkpoint-every 0")  # fmt: skip

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _profiles(tmp_path: Path, data: Path) -> tuple[str, str]:
    """localslurm and localslurm2 with the test's data set and a storage root each."""
    out = []
    for name, root in (("localslurm", "one"), ("localslurm2", "two")):
        profile = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
        profile["storage"] = {**profile["storage"], "data": str(data),
                              "runs": str(tmp_path / root)}  # fmt: skip
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(profile))
        out.append(str(path))
    return out[0], out[1]


def _last_step(run_dir: Path) -> int:
    path = run_dir / runfiles.METRICS / "rank0.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((json.loads(x).get("step", 0) for x in lines if '"step"' in x), default=0)


def _wait_until(what: str, check, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_make_pipeline_preempted_on_cluster_1_fine_tunes_on_cluster_2(
    two_clusters, digits_dir, tmp_path
):
    first, second = _profiles(tmp_path, digits_dir.parent)
    env = {k: v for k, v in os.environ.items() if k != "VITPOD_RUN_ROOT"}  # each its storage
    make = subprocess.Popen(
        ["make", "--no-print-directory", "pipeline", f"CLUSTER={first}", f"FT_CLUSTER={second}",
         "NODES=1", f"ARGS={ARGS} --max-steps 40", "TIME=00:10:00"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert make.stdout is not None
    said = []
    for line in make.stdout:
        said.append(line)
        if (found := re.match(r"pretrain: submitted job (\d+) \((.+)\)", line)) is not None:
            break
    assert found is not None, "".join(said)
    job, pre = found.group(1), Path(found.group(2))
    _wait_until("pretrain step 10", lambda: _last_step(pre) >= 10)
    subprocess.run(["scancel", "-M", two_clusters.first, "--signal=USR2", job], check=True)
    rest, _ = make.communicate(timeout=420)
    said.append(rest)
    assert make.returncode == 0, "".join(said)[-4000:]

    record = json.loads((pre.parent / runfiles.PIPELINE).read_text())
    fin = Path(record["stages"]["finetune"]["run_dir"])
    fin_job = record["stages"]["finetune"]["job_ids"][0]
    assert fin.parent.parent == tmp_path / "two" and pre.parent.parent == tmp_path / "one"
    # sacct on each cluster shows its own stage; the fine-tune was submitted only after the
    # pretrain's last start ended (the preemption requeued it: two starts on cluster 1).
    starts = two_clusters.sacct(two_clusters.first, [job], "JobName,State,Start,End")
    ((pre_name, pre_state, _, pre_end),) = starts
    assert pre_name.endswith("pretrain") and pre_state == "COMPLETED"
    requeued = subprocess.run(
        ["sacct", "-M", two_clusters.first, "-n", "-P", "-X", "-D", "-j", job, "-o", "State"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "REQUEUED" in requeued.stdout or "PREEMPTED" in requeued.stdout, requeued.stdout
    ((fin_name, fin_state, fin_submit),) = two_clusters.sacct(
        two_clusters.second, [fin_job], "JobName,State,Submit"
    )
    assert fin_name.endswith("finetune") and fin_state == "COMPLETED" and fin_submit >= pre_end
    assert two_clusters.sacct(two_clusters.first, [fin_job], "JobName") == []  # not cluster 1's
    # The transferred checkpoint's digest is the pretrain's, in both manifests.
    digest = json.loads((pre / runfiles.FINAL / runfiles.MANIFEST).read_text())["sha256"]
    moved = runfiles.read_manifest(fin)["transfer"]
    assert moved["sha256"] == digest and moved["to_cluster"] == "vitpod2"
    assert runfiles.read_manifest(pre)["transfers"][0]["sha256"] == digest
    config = json.loads((fin / runfiles.CONFIG).read_text())
    assert config["finetune"] == str(Path(moved["to"]).parent.parent)
    # status names the cluster of each stage
    shown = subprocess.run(
        [sys.executable, "-m", "vitpod.workflows", "status", "--run", str(pre.parent)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert re.search(rf"finetune\s+COMPLETED\s+jobs={fin_job} cluster=vitpod2", shown.stdout)


def test_a_damaged_final_model_is_caught_and_starts_no_fine_tune(
    two_clusters, digits_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv("VITPOD_RUN_ROOT", raising=False)  # each stage on its profile's storage
    first, second = _profiles(tmp_path, digits_dir.parent)
    run = Chain(first, "volo_tiny", 1, ARGS + " --max-steps 2", finetune_cluster=second,
                time="00:10:00").submit()  # fmt: skip
    pre, fin = run.stages["pretrain"], run.stages["finetune"]
    # The pretrain's end, watched here: the chain has not looked yet, so nothing handed over.
    jobstate.wait_jobs(jobstate.JobStatePoller(pre.job_ids), timeout=240, poll_s=1)
    model = pre.run_dir / runfiles.FINAL / runfiles.FINAL_MODEL
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))

    with pytest.raises(ChainError, match="copies failed.*sha256"):
        run.wait(timeout=60, poll_s=1)
    assert fin.job_ids == [] and fin.state == chain_cross.REFUSED
    source = Path(fin.job_plan.request.finetune_from)
    assert not (source / runfiles.FINAL / runfiles.FINAL_MODEL).exists()
    record = json.loads((run.directory / runfiles.PIPELINE).read_text())
    assert "sha256" in record["handover"]["error"]
    assert record["stages"]["finetune"]["state"] == chain_cross.REFUSED
