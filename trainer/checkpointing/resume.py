"""How a start picks and loads its checkpoint: one verdict, reached by rank 0 and acted on by
every rank alike, by cause. Damage the bytes prove (checkpoint_commit.check) skips the
checkpoint, which is set aside once the one before has loaded; a checkpoint that does not fit
the run (its recorded settings, or an intact one that fails to load) is a ResumeError (exit 2);
a storage error is retried, then a StorageError. Only the damaged are ever moved."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vitpod.registry import io, runfiles
from vitpod.trainer.checkpointing import checkpoint_commit as commit
from vitpod.trainer.checkpointing import elastic as elastic_rules
from vitpod.trainer.checkpointing import reads

log = logging.getLogger(__name__)
STEP_PREFIX = "step_"
DISCARDED = runfiles.CHECKPOINT_DISCARDED  # damaged step directories set aside (never deleted)


class ResumeError(RuntimeError):
    """The newest valid checkpoint cannot be resumed by this job (said before any step)."""


StorageError = reads.StorageError

# The settings a checkpoint records that fix its state's shapes or layout, and their flags.
SETTING_FLAGS = {"model": "--model", "img_size": "--img-size", "num_classes": "--num-classes",
                 "engine": "--deepspeed/--zero-stage/--fsdp/--tp/--pp"}  # fmt: skip


def run_settings(cfg: Any, classes: int, engine: str) -> dict[str, Any]:
    """What a checkpoint's state must match to be resumed (compared before it is loaded)."""
    return {"model": cfg.model, "img_size": cfg.img_size, "num_classes": classes,
            "engine": engine_state(engine, cfg.zero_stage)}  # fmt: skip


def engine_state(engine: str, zero_stage: int) -> str:
    """How an engine lays out its checkpointed state (what must match to load it)."""
    if engine == "deepspeed":
        return f"deepspeed ZeRO-{zero_stage}"
    if engine in ("fsdp", "mesh"):
        return "sharded DCP (--fsdp/--tp/--pp)"
    return "replicated (DDP)"


class ResumeVerdicts:
    """The resume half of Checkpointer (checkpoint.py), which provides these attributes."""

    root: Path
    rank: int
    world_size: int
    elastic: elastic_rules.Resize | None
    settings: dict[str, Any]
    launch: str
    _written: set[int]

    def step_dirs(self) -> list[Path]:
        raise NotImplementedError

    def saved_world_size(self, directory: Path) -> int | None:
        """How many ranks wrote the checkpoint (its commit marker says), None if unreadable."""
        try:
            return int(commit.read_commit(directory)["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def verify(self, directory: Path) -> str | None:
        """None if the checkpoint is complete (committed, every rank's files listed, present
        with their checksums), else the damage that makes it unusable. A storage error is
        raised (OSError): it proves nothing about the checkpoint."""
        return commit.check(directory, checksums=True)

    def latest_valid(self) -> Path | None:
        """Newest complete checkpoint; damaged ones are skipped with a warning. A storage error
        is retried, then raised as StorageError (nothing is skipped for it)."""
        return reads.retried(f"reading the checkpoints under {self.root}", self._latest_valid)

    def _latest_valid(self) -> Path | None:
        for directory in self.step_dirs():
            reason = self.verify(directory)
            if reason is None:
                return directory
            log.warning("skipping checkpoint %s: %s", directory, reason)
        return None

    def agree_on_latest(self) -> Path | None:
        """Rank 0 picks (it reads the shared storage once) and tells every rank, which all act
        on the one verdict: the pick, ResumeError (another world size, settings that do not
        fit) or StorageError. Nothing is moved here."""
        return self._agree(lambda: self._judge(self.latest_valid()))

    def agree_on_path(self, directory: Path) -> Path:
        """An explicitly named checkpoint, verified and checked as an automatic pick is."""

        def judge() -> Path:
            problem = reads.retried(f"reading {directory}", lambda: self.verify(directory))
            if problem:
                raise ResumeError(f"--resume {directory}: {problem}")
            found = self._judge(directory)
            assert found is not None
            return found

        found = self._agree(judge)
        assert found is not None
        return found

    def _judge(self, found: Path | None) -> Path | None:
        """`found`, or ResumeError saying why this job may not resume it."""
        if found is not None:
            reason = self._refusal(found) or self._settings_differ(found)
            if reason:
                raise ResumeError(reason)
        return found

    def _agree(self, decide: Callable[[], Path | None]) -> Path | None:
        """Run `decide` on rank 0, broadcast its outcome, act on it on every rank alike."""
        verdict: list[Any] = [None, None, None, None]  # path, error kind, message, errno
        if self.rank == 0:
            try:
                found = decide()
                verdict[0] = None if found is None else str(found)
            except ResumeError as exc:
                verdict[1:3] = ["refuse", str(exc)]
            except StorageError as exc:
                verdict[1:] = ["storage", str(exc), exc.errno]
            except Exception as exc:  # every rank must leave the broadcast below
                verdict[1:3] = ["error", f"{type(exc).__name__}: {exc}"]
                if dist.is_initialized():
                    dist.broadcast_object_list(verdict, src=0)
                raise
        if dist.is_initialized():
            dist.broadcast_object_list(verdict, src=0)
        _raise_verdict(verdict[1], verdict[2], verdict[3])
        return None if verdict[0] is None else Path(verdict[0])

    def resume(self, resume: str, load: Callable[[Path], None], device: torch.device) -> None:
        """Load (with `load`, on every rank) the newest complete checkpoint. Damaged ones
        (their bytes differ from COMMIT.json) are skipped and, once the resume is agreed,
        moved to discarded/. One that does not fit this run stops every rank with ResumeError,
        a storage error that persists with StorageError, both before any step and with
        nothing moved. An explicit `resume` PATH is a first start's choice: once the run has a
        checkpoint of its own (a requeue), that one is resumed."""
        if resume == "none":  # a fresh start writes step_N over the run's own: refused
            self._agree(lambda: reads.retried(f"reading the checkpoints under {self.root}",
                                              self._fresh_start_refusal))  # fmt: skip
            return
        directory = self.agree_on_latest()
        if directory is None and resume != "auto":
            directory = self.agree_on_path(Path(resume))
        elif directory is not None and resume != "auto":
            log.info("--resume %s applies to a first start only: this run has its own "
                     "checkpoint %s", resume, directory)  # fmt: skip
        if directory is not None:
            self._load_agreed(load, directory, device)
            if directory.parent == self.root:
                self._written.add(int(directory.name.removeprefix(STEP_PREFIX)))
        if self.rank == 0:  # every rank has loaded: the damaged ones newer go aside now
            self.discard_newer_than(directory if directory and directory.parent == self.root
                                    else None)  # fmt: skip

    def _fresh_start_refusal(self) -> None:
        """ResumeError when the run already holds committed checkpoints: --resume none would
        rewrite their steps in place (and a requeue would resume the older run's newest)."""
        committed = [d.name for d in self.step_dirs() if (d / commit.COMMIT).exists()]
        if committed:
            raise ResumeError(
                f"--resume none: {self.root} already holds committed checkpoints "
                f"({', '.join(reversed(committed))}); a fresh start there would overwrite them. "
                "Nothing was moved or deleted. To train from scratch, use a new run directory "
                f"(--output NEW); to continue this run, --resume auto; to start from its "
                f"weights, --finetune {self.root.parent}"
            )

    def _load_agreed(
        self, load: Callable[[Path], None], directory: Path, device: torch.device
    ) -> None:
        """`load` on every rank; a storage error on any rank is retried by all, a checkpoint
        that does not load stops all with one message."""
        del device  # the verdicts travel as objects
        for tries, delay in enumerate((*reads.RETRY_DELAYS_S, None), 1):
            outcomes = _gather(self._try_load(load, directory))
            storage = [o for o in outcomes if o and o[0] == "storage"]
            refused = [o for o in outcomes if o and o[0] == "refuse"]
            if storage and delay is not None:
                log.warning("loading %s: %s; every rank retries in %.0f s", directory,
                            storage[0][1], delay)  # fmt: skip
                time.sleep(delay)
                continue
            if storage:
                raise reads.storage_error(f"loading {directory}", storage[0][1], tries,
                                          storage[0][2])  # fmt: skip
            if refused:
                raise ResumeError(refused[0][1])
            return

    def _try_load(self, load: Callable[[Path], None], directory: Path) -> tuple[Any, ...] | None:
        """None, ("storage", message, errno) or ("refuse", message)."""
        try:
            load(directory)
        except ResumeError as exc:
            return ("refuse", str(exc))
        except Exception as exc:
            if reads.is_storage_error(exc):
                text = f"rank {self.rank}: {type(exc).__name__}: {exc}"
                return ("storage", text, reads.storage_errno(exc))
            return ("refuse", self._does_not_load(directory, exc))
        return None

    def _does_not_load(self, directory: Path, exc: BaseException) -> str:
        """Its files match COMMIT.json, so the checkpoint is intact: this run differs."""
        text = f"{type(exc).__name__}: {exc}"
        text = text if len(text) < 600 else text[:600] + " ..."
        differ = self._differences(directory)
        return (
            f"checkpoint {directory} (intact: its files match {commit.COMMIT}) does not load "
            f"into this run{': ' + differ if differ else ''} ({text}). Nothing was moved or "
            f"deleted. {_FIX.format(run=directory.parent.parent)}"
        )

    def _settings_differ(self, directory: Path) -> str | None:
        differ = self._differences(directory)
        if not differ:
            return None
        return (
            f"checkpoint {directory} does not fit this run: {differ}. Nothing was moved or "
            f"deleted. {_FIX.format(run=directory.parent.parent)}"
        )

    def _differences(self, directory: Path) -> str:
        """Each recorded setting that differs: '--img-size: 32 in the checkpoint, 48 here'."""
        try:
            saved = commit.read_commit(directory).get("settings") or {}
        except (OSError, ValueError):
            return ""
        return "; ".join(
            f"{SETTING_FLAGS.get(key, key)}: {saved[key]} in the checkpoint, {value} in this run"
            for key, value in self.settings.items()
            if key in saved and saved[key] != value
        )

    def discard_newer_than(self, keep: Path | None) -> None:
        """Move step directories newer than `keep` to checkpoints/discarded/ (rank 0, after
        every rank loaded `keep`, before any rank of this start writes): each was found
        damaged or uncommitted, and a step directory never mixes two starts' files."""
        for directory in self.step_dirs():
            if keep is not None and directory.name <= keep.name:
                break
            self.discard(directory)

    def discard(self, directory: Path) -> None:
        """Move an unusable step directory aside (kept until removed by hand or `vitpod
        clean`; rotation never looks there)."""
        target = self.root / DISCARDED / f"{directory.name}.{self.launch}"
        target.parent.mkdir(exist_ok=True)
        log.warning("moving unusable checkpoint %s to %s", directory, target)
        directory.rename(target)
        io.fsync_dir(self.root)

    def _refusal(self, directory: Path) -> str | None:
        """Why this job may not resume `directory`, or None.

        Another world size is fine when the global batch is the same (so the LR, the steps per
        epoch and the schedule's position, and the samples of each step are) and the engine's
        state is replicated (DDP) or reshardable (DCP): see trainer/checkpointing/elastic.py.
        Otherwise the global batch, the per-rank files or DeepSpeed's ZeRO partitions belong to the
        world size that wrote them.
        """
        saved = self.saved_world_size(directory)
        if saved is None or saved == self.world_size:
            return None
        if self.elastic is not None:
            return self.elastic.refusal(directory, saved, self.world_size)
        return (
            f"checkpoint {directory} was written by {saved} ranks, this job has "
            f"{self.world_size}: resume it with {saved} ranks (as many nodes x tasks as "
            "before), or start over in a new run directory (--resume none, or --finetune "
            "from it)"
        )


_FIX = (
    "To continue it, resume with the settings that wrote it; to train these settings from "
    "scratch, use a new run directory (--output NEW, or --resume none there); to start from "
    "its weights, --finetune {run}"
)


def _raise_verdict(kind: str | None, message: Any, code: Any = None) -> None:
    if kind == "refuse":
        raise ResumeError(str(message))
    if kind == "storage":
        raise StorageError(str(message), code)
    if kind == "error":
        raise RuntimeError(f"rank 0 could not choose a checkpoint: {message}")


def _gather(outcome: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [outcome]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, outcome)
    return every
