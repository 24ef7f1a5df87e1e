"""Checkpoints against the user and the storage: a resume that does not fit the run stops with
exit 2 and moves nothing; a storage error is retried, then stops every rank alike and moves
nothing; only proven damage sets a checkpoint aside, and nothing set aside is ever deleted; a
step is written once per start; only `step_<9 digits>` directories are checkpoints; a
preemption at an epoch's last step resumes at the next epoch's first step, bit for bit.

Storage errors come through the checkpoint reader's test-only hook (VITPOD_TEST_IO_FAULT,
trainer/checkpointing/reads.py), not a patched torch; the preemption is a real SIGUSR2 held at
the epoch's last step by VITPOD_TEST_HOLD_AT_STEP (trainer/checkpointing/preempt.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port, logs, preempt_at, run_ranks, start_ranks, wait_ranks
from vitpod.registry import runfiles
from vitpod.trainer.checkpointing import checkpoint_commit as commit
from vitpod.trainer.checkpointing import reads
from vitpod.trainer.checkpointing.checkpoint import (
    Checkpointer,
    ResumeError,
    StorageError,
    engine_state,
)
from vitpod.trainer.exitcodes import OK, REQUEUE, USAGE

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
STEPS_PER_EPOCH = 23  # 1433 digits over 2 ranks x 32: 22 full steps and a partial 23rd
SETTINGS = {"model": "volo_tiny", "img_size": 32, "num_classes": 10, "engine": "replicated (DDP)"}


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((64,), float(step))}, "step": step}


def _saved(root: Path, steps=(10, 20, 30), **kwargs) -> Checkpointer:
    ck = Checkpointer(root, rank=0, world_size=1, keep_last=5, settings=SETTINGS, **kwargs)
    for step in steps:
        ck.save(step, epoch=int(step == 10), state=_state(step), epoch_end=step == 10)
    ck.close()
    return ck


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` with its sha256: what "nothing moved or changed" compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def quick_retries(monkeypatch) -> None:
    monkeypatch.setattr(reads, "RETRY_DELAYS_S", (0.01, 0.02))
    monkeypatch.setattr(reads, "_faults_left", {})


# ----------------------------------------------------------------- a run that does not fit
def test_settings_that_differ_stop_the_resume_naming_each_and_move_nothing(tmp_path: Path):
    _saved(tmp_path)
    before = _tree(tmp_path)
    run = Checkpointer(tmp_path, rank=0, world_size=1,
                       settings={**SETTINGS, "img_size": 48, "num_classes": 20})  # fmt: skip
    loaded: list[Path] = []
    with pytest.raises(ResumeError) as info:
        run.resume("auto", loaded.append, CPU)
    message = str(info.value)
    assert "--img-size: 32 in the checkpoint, 48 in this run" in message
    assert "--num-classes: 10 in the checkpoint, 20 in this run" in message
    assert "--model" not in message and "Nothing was moved or deleted" in message
    assert "new run directory" in message and "--finetune" in message
    assert loaded == [] and _tree(tmp_path) == before
    fsdp = Checkpointer(tmp_path, 0, 1, settings={**SETTINGS, "engine": engine_state("fsdp", 0)})
    with pytest.raises(
        ResumeError, match="--fsdp/--tp/--pp: replicated \\(DDP\\) in the checkpoint"
    ):
        fsdp.resume("auto", loaded.append, CPU)
    assert loaded == [] and _tree(tmp_path) == before


def test_a_fresh_start_over_committed_checkpoints_is_refused_and_moves_nothing(tmp_path: Path):
    """--resume none in a run that holds checkpoints rewrote step_N in place (and a requeue then
    resumed the older run's newest step): refused, naming them and a new run directory."""
    _saved(tmp_path / "run" / "checkpoints")
    before = _tree(tmp_path)
    fresh = Checkpointer(tmp_path / "run" / "checkpoints", 0, 1, settings=SETTINGS)
    with pytest.raises(ResumeError) as info:
        fresh.resume("none", lambda d: None, CPU)
    message = str(info.value)
    assert "step_000000010, step_000000020, step_000000030" in message
    assert "new run directory (--output NEW)" in message and "Nothing was moved" in message
    assert _tree(tmp_path) == before
    other = tmp_path / "other" / "checkpoints"  # a user's copy and an uncommitted step only
    (other / "step_backup").mkdir(parents=True)
    (other / "step_000000004").mkdir()
    Checkpointer(other, 0, 1, settings=SETTINGS).resume("none", lambda d: None, CPU)


def test_an_intact_checkpoint_that_does_not_load_stops_the_resume(tmp_path: Path):
    """No recorded settings (an older checkpoint): the load's own error decides, never the
    checksums, so the checkpoint is not set aside and the one before is not tried."""
    ck = Checkpointer(tmp_path, rank=0, world_size=1)
    for step in (10, 20):
        ck.save(step, epoch=0, state=_state(step))
    ck.close()
    before = _tree(tmp_path)
    model = torch.nn.Linear(8, 8)

    def load(directory: Path) -> None:
        model.load_state_dict({"weight": ck.load(directory)[0]["model"]["w"]})

    with pytest.raises(ResumeError, match=r"step_000000020 \(intact.*does not load") as info:
        ck.resume("auto", load, CPU)
    assert "Missing key" in str(info.value) and "Nothing was moved" in str(info.value)
    assert _tree(tmp_path) == before


# ----------------------------------------------------------------- the storage fails
@pytest.mark.usefixtures("quick_retries")
def test_a_transient_read_error_is_retried_and_moves_nothing(tmp_path: Path, monkeypatch, caplog):
    ck = _saved(tmp_path)
    before = _tree(tmp_path)
    monkeypatch.setenv(reads.FAULT_ENV, "EIO:2:COMMIT.json")
    loaded: list[Path] = []
    with caplog.at_level(logging.WARNING):
        ck.resume("auto", loaded.append, CPU)
    assert loaded == [ck.step_dir(30)] and _tree(tmp_path) == before
    assert "retrying" in caplog.text and "skipping" not in caplog.text


@pytest.mark.usefixtures("quick_retries")
@pytest.mark.parametrize("fault", ["EIO:99:COMMIT.json", "ESTALE:99:rank0.pt"])
def test_a_persistent_read_error_stops_the_resume_and_moves_nothing(
    tmp_path: Path, monkeypatch, fault: str
) -> None:
    ck = _saved(tmp_path, milestone_every=1)  # step 10 is a milestone
    before = _tree(tmp_path)
    monkeypatch.setenv(reads.FAULT_ENV, fault)
    with pytest.raises(StorageError, match=rf"checkpoint storage error \({fault.split(':')[0]}\)"):
        ck.resume("auto", lambda d: None, CPU)
    assert _tree(tmp_path) == before
    monkeypatch.delenv(reads.FAULT_ENV)
    rotating = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1, milestone_every=1)
    rotating.save(40, epoch=0, state=_state(40))  # rotation afterwards keeps the milestone
    rotating.close()
    assert [p.name for p in rotating.step_dirs()] == ["step_000000040", "step_000000010"]


@pytest.mark.usefixtures("quick_retries")
def test_a_storage_error_while_loading_is_retried_then_stops(tmp_path: Path) -> None:
    """The engine's own reads (DCP, DeepSpeed) raise the filesystem's OSError: every rank
    retries the load together, then stops with the storage error, naming its errno."""
    import errno

    ck = _saved(tmp_path)
    before = _tree(tmp_path)
    calls: list[Path] = []

    def flaky(directory: Path) -> None:
        calls.append(directory)
        if len(calls) < 2:
            raise OSError(errno.ESTALE, "Stale file handle", str(directory / "dcp"))

    ck.resume("auto", flaky, CPU)
    assert calls == [ck.step_dir(30)] * 2

    def stale(directory: Path) -> None:
        raise OSError(errno.ESTALE, "Stale file handle", str(directory / "dcp"))

    again = Checkpointer(tmp_path, rank=0, world_size=1, settings=SETTINGS)
    with pytest.raises(StorageError, match=r"storage error \(ESTALE\) loading .*step_000000030"):
        again.resume("auto", stale, CPU)
    assert _tree(tmp_path) == before


class _CutWhileRead:
    """An open file whose bytes end early once reading starts (the size seen at open stays)."""

    def __init__(self, path: Path) -> None:
        self.path, self.fh = path, open(path, "rb")

    def fileno(self) -> int:
        return self.fh.fileno()

    def read(self, size: int = -1) -> bytes:
        os.truncate(self.path, 4)
        return self.fh.read(size)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.fh.close()


def test_a_short_read_is_a_storage_error_not_damage(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "rank0.pt"
    path.write_bytes(b"x" * 10)
    monkeypatch.setattr(reads, "open_read", _CutWhileRead)
    with pytest.raises(OSError, match="short read: 4 of 10 bytes") as info:
        reads.sha256_of(path)
    assert reads.is_storage_error(info.value)


def _rank(root: Path, rank: int, port: int, results) -> None:
    """One of 2 gloo ranks resuming `root` (forked: torch is imported already); rank 0 alone
    gets EACCES on every COMMIT.json read."""
    import torch.distributed as dist

    if rank == 0:
        os.environ[reads.FAULT_ENV] = "EACCES:99:COMMIT.json"
    reads.RETRY_DELAYS_S = (0.01,)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        Checkpointer(root, rank, 2, launch="probe").resume("auto", lambda d: None, CPU)
        results.put((rank, "resumed"))
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__} {str(exc).split(';')[0]}"))
    dist.destroy_process_group()


def test_rank0_that_cannot_read_stops_every_rank_with_the_same_error(tmp_path: Path) -> None:
    """EACCES on every COMMIT.json read, on rank 0 only: both ranks end with rank 0's storage
    error (none waits in a collective), and nothing moves."""
    import multiprocessing

    root = tmp_path / "checkpoints"
    for rank in (1, 0):
        ck = Checkpointer(root, rank=rank, world_size=2, launch="start1")
        ck.save(5, 0, _state(5))
        ck.close()
    before = _tree(root)
    fork = multiprocessing.get_context("fork")
    results, port = fork.Queue(), free_port()
    procs = [fork.Process(target=_rank, args=(root, r, port, results)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    said = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert said[0] == said[1], said
    assert said[0].startswith("StorageError checkpoint storage error (EACCES)"), said
    assert _tree(root) == before


# ----------------------------------------------------------------- proven damage only
def test_a_commit_listing_no_or_too_few_files_is_not_complete(tmp_path: Path) -> None:
    ck = _saved(tmp_path, steps=(10, 20))
    marker = ck.step_dir(20) / commit.COMMIT
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "files": {}}))
    assert "does not list rank0.pt, rank0.json" in (ck.verify(ck.step_dir(20)) or "")
    marker.write_text(json.dumps({**record, "world_size": 2}))  # rank 1's files not listed
    assert "does not list rank1.pt, rank1.json" in (ck.verify(ck.step_dir(20)) or "")
    assert ck.latest_valid() == ck.step_dir(10)


# ----------------------------------------------------------------- written once per start
def test_a_step_is_written_once_per_start(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, rank=0, world_size=1)
    ck.save(7, epoch=0, state=_state(7))
    ck.wait()
    first = _tree(tmp_path)
    ck.save(7, epoch=1, state=_state(99), epoch_end=True)  # the same step again: skipped
    ck.close()
    assert _tree(tmp_path) == first
    resumed = Checkpointer(tmp_path, rank=0, world_size=1)  # the next start resumes step 7...
    resumed.resume("auto", lambda d: None, CPU)
    resumed.save(7, epoch=1, state=_state(99), epoch_end=True)  # ...and does not rewrite it
    resumed.close()
    assert _tree(tmp_path) == first


def test_the_commit_waits_for_this_saves_rank_records(tmp_path: Path) -> None:
    """Rank 1's record of an earlier save by the same start is not this save's."""
    step = tmp_path / "step_000000005"
    step.mkdir()
    for rank in (0, 1):
        (step / f"rank{rank}.pt").write_bytes(b"x")
    (step / "rank0.json").write_text(json.dumps({"launch": "L", "save": 2, "file": "rank0.pt"}))
    (step / "rank1.json").write_text(json.dumps({"launch": "L", "save": 1, "file": "rank1.pt"}))
    with pytest.raises(commit.CommitTimeout, match="still waiting for rank1.json"):
        commit.commit(step, {"step": 5, "save": 2}, 2, "L", timeout_s=0.3)
    assert not (step / commit.COMMIT).exists()


# ----------------------------------------------------------------- names
def test_only_step_directories_with_nine_digits_are_checkpoints(tmp_path: Path) -> None:
    ck = _saved(tmp_path, steps=(1, 3))
    backup = tmp_path / "step_backup"
    keep = tmp_path / "step_000000001_keep"
    for copy in (backup, keep):
        subprocess.run(["cp", "-a", str(ck.step_dir(3)), str(copy)], check=True)
    (ck.step_dir(3) / commit.COMMIT).unlink()  # the newest real one is incomplete
    before = {p: _tree(p) for p in (backup, keep)}
    loaded: list[Path] = []
    ck.resume("auto", loaded.append, CPU)
    assert loaded == [ck.step_dir(1)]  # not step_backup, though it sorts after
    rotating = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1)
    for step in (5, 6):
        rotating.save(step, epoch=0, state=_state(step))
    rotating.close()
    assert [p.name for p in rotating.step_dirs()] == ["step_000000006"]
    assert {p: _tree(p) for p in (backup, keep)} == before  # not resumed, rotated or moved
    assert not list((tmp_path / "discarded").glob("step_b*"))


# ----------------------------------------------------------------- epoch boundaries
def test_a_loader_resumed_after_an_epochs_last_batch_gives_nothing_more(
    digits_half_dir: Path,
) -> None:
    """The root cause of the epoch-boundary bug: a loader position at the end of the epoch (its
    last, partial step consumed every sample) read as "start the epoch over", so the resumed
    run trained epoch 0 again. Now the epoch has nothing left and the trainer ends it."""
    from tests.fixtures_data import data_config
    from vitpod.trainer.data import create_loader

    cfg = data_config(digits_half_dir, {"batch_size": 32, "workers": 0}, loader="torch")
    first = create_loader(cfg, "train", 1, 2)
    first.set_epoch(0)
    batches = iter(first)
    for _ in range(12):  # 716 images over 2 x 32: 11 full steps and a partial 12th
        next(batches)
    assert first.at_epoch_end()
    state = first.state_dict()
    assert state["samples_done"] == state["num_samples"]  # the partial step read the last
    resumed = create_loader(cfg, "train", 1, 2)
    resumed.set_epoch(0)
    resumed.load_state_dict(state)
    assert list(resumed) == [] and resumed.at_epoch_end()


DIGITS_ARGS = [
    "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "-b", "32",
    "--epochs", "2", "--warmup-epochs", "1", "--lr", "2e-3", "--drop-path", "0.1",
    "--checkpoint-every", "5", "--log-interval", "1", "--seed", "3", "--max-steps", "26",
    "--hflip", "0.5", "--scale", "0.08", "1",
]  # fmt: skip
ENGINES = {
    "dali-zero3": ["--loader", "dali", "--workers", "1", "--deepspeed", "--zero-stage", "3",
                   "--no-eval"],
    "torch-ddp": ["--loader", "torch", "--workers", "0"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_preemption_at_an_epochs_last_step_resumes_bit_exact(
    digits_dir: Path, tmp_path: Path, monkeypatch, engine: str
) -> None:
    if engine.startswith("dali"):
        pytest.importorskip("nvidia.dali")
        pytest.importorskip("deepspeed")
    args = [str(digits_dir), *DIGITS_ARGS, *ENGINES[engine]]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    codes = run_ranks(2, [*args, "--output", str(reference)], tmp_path / "l0", timeout=600)
    assert codes == [OK, OK], logs(tmp_path / "l0")

    monkeypatch.setenv("VITPOD_TEST_HOLD_AT_STEP", f"{STEPS_PER_EPOCH}:20")
    procs = start_ranks(2, [*args, "--output", str(stopped)], tmp_path / "l1")
    preempt_at(stopped, STEPS_PER_EPOCH, procs, rank=1)  # held there: the signal lands there
    assert wait_ranks(procs, tmp_path / "l1", 600) == [REQUEUE, REQUEUE], logs(tmp_path / "l1")
    assert f"checkpointed at step {STEPS_PER_EPOCH}" in logs(tmp_path / "l1")
    monkeypatch.delenv("VITPOD_TEST_HOLD_AT_STEP")
    codes = run_ranks(2, [*args, "--output", str(stopped)], tmp_path / "l2", timeout=600)
    assert codes == [OK, OK], logs(tmp_path / "l2")

    ref_steps, got_steps = (
        {r["step"]: r for r in runfiles.read_metrics(run, 0) if r["kind"] == "step"}
        for run in (reference, stopped)
    )
    assert got_steps[STEPS_PER_EPOCH + 1]["epoch"] == 1 == ref_steps[STEPS_PER_EPOCH + 1]["epoch"]
    assert [got_steps[s]["loss"] for s in sorted(got_steps)] == [
        ref_steps[s]["loss"] for s in sorted(ref_steps)
    ]
    evals = [r["epoch"] for r in runfiles.read_metrics(stopped, 0) if r["kind"] == "eval"]
    if "--no-eval" not in ENGINES[engine]:  # epoch 0's evaluation, left to the resumed start
        assert 0 in evals
    want = torch.load(reference / "final" / "model.pt", weights_only=True)
    got = torch.load(stopped / "final" / "model.pt", weights_only=True)
    assert any(k.endswith("num_batches_tracked") for k in want)  # BatchNorm counters compared
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    if engine == "torch-ddp":  # the same run resumed by mistake at another size: exit 2
        before = _tree(stopped / "checkpoints")
        mistaken = [*args, "--output", str(stopped), "--img-size", "48", "--max-steps", "40"]
        assert run_ranks(2, mistaken, tmp_path / "l3") == [USAGE, USAGE], logs(tmp_path / "l3")
        assert "--img-size: 32 in the checkpoint, 48 in this run" in logs(tmp_path / "l3")
        assert _tree(stopped / "checkpoints") == before


def test_status_names_a_storage_error_and_what_is_set_aside_or_foreign(tmp_path: Path) -> None:
    from vitpod.workflows.watching.metricstail import newest_checkpoint_age
    from vitpod.workflows.watching.status import checkpoint_notes
    from vitpod.workflows.watching.triage import diagnose

    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    error = reads.storage_error("reading the checkpoints", OSError(5, "Input/output error"), 5)
    (logs_dir / "train-9-restart0-rank1.log").write_text(
        f'Traceback (most recent call last):\n  File "x.py", line 1\nStorageError: {error}\n'
    )
    found = diagnose(logs_dir, "FAILED", "1:0")
    assert found is not None and found.cause.startswith("checkpoint storage error"), found
    assert "no checkpoint was moved or deleted" in found.fix
    root = tmp_path / "checkpoints"
    for name in ("step_000000004", "discarded/step_000000008.abc", "step_backup"):
        (root / name).mkdir(parents=True)
    notes = checkpoint_notes(tmp_path)
    assert len(notes) == 2
    (root / "step_backup" / commit.COMMIT).write_text("{}")  # a user's copy: no checkpoint age
    assert newest_checkpoint_age(tmp_path, now=0.0) is None
    assert "set aside as damaged (kept): step_000000008.abc" in notes[0]
    assert notes[1].endswith(": step_backup")
