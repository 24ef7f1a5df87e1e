"""One teacher per token-label directory, one writer per shard, and shards that name their teacher.

Real labeler processes (`python -m vitpod.trainer.tokenlabels.label`) race for one directory: a
second teacher is refused with both digests (exit 2) and writes nothing; two jobs of one teacher on
one shard queue on the shard's flock and the second skips it. The trainer's store refuses a shard
whose recorded teacher digest is not the manifest's, also in a DataLoader worker's copy after the
directory was relabeled under it.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_until
from vitpod.registry import labelset
from vitpod.trainer.checkpointing.checkpoint import save_final
from vitpod.trainer.data import DataConfig
from vitpod.trainer.data.token_label import TokenLabelError, TokenLabelStore
from vitpod.trainer.model.models import create_model, model_manifest
from vitpod.trainer.tokenlabels import label
from vitpod.workflows.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SHARDS = 40  # about 36 images a shard: each labeler process is mostly its start-up


def _teacher(root: Path, seed: int) -> tuple[Path, str]:
    torch.manual_seed(seed)
    model = create_model("volo_tiny", 32, 10, 0.0)
    save_final(root, model.state_dict(), model_manifest("volo_tiny", 32, 10))
    return root, labelset.weights_digest(root / "final" / "model.pt")


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    base = tmp_path_factory.mktemp("teachers")
    return {"a": _teacher(base / "a", 0), "b": _teacher(base / "b", 1)}


def _argv(data: Path, teacher: Path, out: Path, shard: int, shards: int = SHARDS) -> list[str]:
    return [str(data), "--teacher", str(teacher), "--label-dir", str(out), "--img-size", "32",
            "--topk", "3", "--shard", str(shard), "--num-shards", str(shards)]  # fmt: skip


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "vitpod.trainer.tokenlabels.label", *argv], cwd=REPO, env=env,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _wait_for(text: str, logs: list[Path], timeout: float = 120) -> None:
    def found() -> bool:
        return all(log.is_file() and text in log.read_text() for log in logs)

    wait_until(f"{text!r} in every log of {logs}", found, timeout, interval=0.2)


def test_two_teachers_racing_for_one_directory_one_is_refused_with_both_digests(
    digits_dir, teachers, tmp_path
):
    (run_a, digest_a), (run_b, digest_b) = teachers["a"], teachers["b"]
    out = tmp_path / "tl"
    # Both start together, each on its own shard, as two chains' arrays would.
    procs = {
        "a": _start(_argv(digits_dir, run_a, out, 0), tmp_path / "a.log"),
        "b": _start(_argv(digits_dir, run_b, out, 1), tmp_path / "b.log"),
    }
    rcs = {k: p.wait(timeout=300) for k, p in procs.items()}
    assert sorted(rcs.values()) == [0, 2], rcs
    won = next(k for k, rc in rcs.items() if rc == 0)
    lost = "b" if won == "a" else "a"
    refusal = (tmp_path / f"{lost}.log").read_text()
    digests = {"a": digest_a, "b": digest_b}
    assert f"belongs to teacher sha256 {digests[won]}" in refusal
    assert f"this teacher is sha256 {digests[lost]}" in refusal
    assert "--label-dir DIR" in refusal
    owner = labelset.read_owner(out)
    assert owner is not None and owner["weights_sha256"] == digests[won]
    lost_shard = labelset.shard_path(out, 1 if lost == "b" else 0, SHARDS)
    assert not lost_shard.exists() and not lost_shard.with_suffix(".json").exists()
    # Later, the other teacher again (a requeue of its array): still refused, nothing rewritten.
    won_shard = labelset.shard_path(out, 0 if won == "a" else 1, SHARDS)
    before = won_shard.stat().st_mtime_ns
    runs = {"a": run_a, "b": run_b}
    assert label.main(_argv(digits_dir, runs[lost], out, 0 if won == "a" else 1)) == 2
    assert won_shard.stat().st_mtime_ns == before
    part = torch.load(won_shard, weights_only=True)
    assert part["teacher_sha256"] == digests[won]


def test_one_teachers_two_jobs_on_one_shard_wait_for_its_lock_and_the_second_skips_it(
    digits_dir, teachers, tmp_path
):
    run_a, _ = teachers["a"]
    out = tmp_path / "tl"
    lock = labelset.shard_path(out, 3, SHARDS).with_suffix(".lock")
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    with labelset.locked(lock):  # a third party holds the shard: both must queue behind it
        procs = [_start(_argv(digits_dir, run_a, out, 3), log) for log in logs]
        _wait_for("waiting for the lock", logs)
        assert all(p.poll() is None for p in procs)
        assert not labelset.shard_path(out, 3, SHARDS).exists()
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    texts = [log.read_text() for log in logs]
    assert sum("already done" in t for t in texts) == 1, texts
    assert sum(f"shard 3/{SHARDS}: " in t and "images in" in t for t in texts) == 1, texts


def _labels(digits_dir: Path, teacher: Path, out: Path) -> Path:
    for shard in range(2):
        assert label.main(_argv(digits_dir, teacher, out, shard, shards=2)) == 0
    return out


def _store_cfg(digits_dir: Path, labels: Path) -> DataConfig:
    return DataConfig(data_dir=str(digits_dir), img_size=32, token_label=True,
                      token_label_data=str(labels), token_label_size=2)  # fmt: skip


def test_a_shard_recording_another_teachers_digest_is_refused_naming_both(
    digits_dir, teachers, tmp_path
):
    (run_a, digest_a), (_, digest_b) = teachers["a"], teachers["b"]
    labels = _labels(digits_dir, run_a, tmp_path / "tl")
    cfg = _store_cfg(digits_dir, labels)
    assert TokenLabelStore.open(cfg, 10).teacher_sha256 == digest_a  # all shards of teacher a
    shard = labelset.shard_path(labels, 1, 2)
    part = torch.load(shard, weights_only=True)
    part["teacher_sha256"] = digest_b  # shard 1 as another teacher's chain would have left it
    torch.save(part, shard)
    with pytest.raises(TokenLabelError) as err:
        TokenLabelStore.open(cfg, 10)
    assert f"made by teacher sha256 {digest_b}" in str(err.value)
    assert f"manifest names teacher sha256 {digest_a}" in str(err.value)
    assert "--token-label-data DIR" in str(err.value)


def test_a_workers_reload_refuses_labels_relabeled_by_another_teacher_since_the_run_opened(
    digits_dir, teachers, tmp_path
):
    (run_a, digest_a), (_, digest_b) = teachers["a"], teachers["b"]
    labels = _labels(digits_dir, run_a, tmp_path / "tl")
    store = TokenLabelStore.open(_store_cfg(digits_dir, labels), 10)
    worker = pickle.loads(pickle.dumps(store))  # what a DataLoader worker gets each epoch
    assert worker.teacher_sha256 == digest_a and len(worker.data["index"]) == 1433
    manifest = labelset.read_manifest(labels)
    manifest["teacher"]["weights_sha256"] = digest_b  # relabeled: manifest and shards of b
    (labels / labelset.RECORD).write_text(json.dumps(manifest))
    for number in range(2):
        path = labelset.shard_path(labels, number, 2)
        part = torch.load(path, weights_only=True)
        torch.save({**part, "teacher_sha256": digest_b}, path)
    worker = pickle.loads(pickle.dumps(store))
    with pytest.raises(TokenLabelError, match=f"now names teacher sha256 {digest_b}, the run "
                       f"opened it with {digest_a}"):  # fmt: skip
        assert worker.data is None  # raises first


def test_submitting_another_teacher_into_a_claimed_directory_is_refused_before_writing(
    digits_dir, teachers, tmp_path
):
    from vitpod.workflows.pipeline import labels as wlabels

    (run_a, digest_a), (run_b, digest_b) = teachers["a"], teachers["b"]
    out = tmp_path / "tl"
    assert label.main(_argv(digits_dir, run_a, out, 0)) == 0  # labeling, not finished
    assert labelset.read_manifest(out) is None
    job = wlabels.prepare(
        "local", "volo_tiny", teacher=str(run_b), run_dir=tmp_path / "lab",
        args=f"--label-dir {out} --img-size 32",
    )  # fmt: skip
    for force in (False, True):
        with pytest.raises(ConfigError, match=f"belongs to teacher sha256 {digest_a}.*{digest_b}"):
            wlabels.submit(job, force=force)
    assert not (tmp_path / "lab").exists()
    problem = wlabels.teacher_problem(out, str(run_b), "")
    assert problem is not None and digest_a in problem and digest_b in problem
    assert wlabels.teacher_problem(out, str(run_a), "") is None
