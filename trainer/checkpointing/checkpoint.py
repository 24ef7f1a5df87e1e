"""Async, atomic, verified checkpoints: the host copy overlaps the next forward/backward."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vitpod.registry import io, runfiles
from vitpod.trainer.checkpointing import checkpoint_commit as commit
from vitpod.trainer.checkpointing import elastic as elastic_rules
from vitpod.trainer.checkpointing import timm_folder
from vitpod.trainer.checkpointing.host_stage import HostStager
from vitpod.trainer.checkpointing.torchsave import atomic_torch_save
from vitpod.trainer.dist import all_ranks_ok

log = logging.getLogger(__name__)
STEP_PREFIX = "step_"
DISCARDED = "discarded"  # unusable step directories moved aside at a resume


class ResumeError(RuntimeError):
    """The newest valid checkpoint cannot be resumed by this job (said before any step)."""


class Checkpointer:
    """save (async) / wait / latest_valid / load over RUN_DIR/checkpoints/step_N/rank{R}.pt."""

    def __init__(self, root: Path, rank: int, world_size: int, keep_last: int = 3,
                 milestone_every: int = 0, use_async: bool = True,
                 elastic: elastic_rules.Resize | None = None,
                 await_files: Collection[str] = (), commit_timeout_s: float = 1800.0,
                 launch: str | None = None) -> None:  # fmt: skip
        if keep_last < 1:
            raise ValueError(
                "--keep-last must be at least 1 (the newest checkpoint is the resume point)"
            )
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.milestone_every = milestone_every
        self.use_async = use_async
        self.elastic = elastic  # None: a resume needs the world size that wrote the checkpoint
        self.stager = HostStager()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staged = threading.Event()
        self._staged.set()
        self.last_stall_s = 0.0  # time the loop was blocked by the latest save (save + fence)
        # Files another writer finishes on its own (DCP's .metadata, written by its coordinator
        # once every rank's shards are down): the commit waits for them too.
        self._await_files = tuple(await_files)
        self.commit_timeout_s = commit_timeout_s
        self.launch = launch or _agreed_launch_id()
        self.attempt = commit.attempt_record(self.launch)

    def preallocate(self, state: dict[str, Any]) -> None:
        """Allocate (and touch) the host staging buffers now, so the first save stalls no longer."""
        self.stager.stage(state)

    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step:09d}"

    def save(
        self,
        step: int,
        epoch: int,
        state: dict[str, Any],
        epoch_end: bool = False,
        overlap: bool = False,
        copy_now: Collection[int] = (),
    ) -> None:
        """Copy `state` to host buffers, then write, fsync, rename and prune in the background.

        With `overlap`, the copy runs in the background too and the caller must call `fence()`
        before anything mutates the state's tensors in place (the next optimizer step): the
        copy then overlaps the forward/backward in between. Tensors that the forward itself
        changes (BatchNorm running stats: pass their `data_ptr()`s as `copy_now`) are copied
        before this returns.
        """
        start = time.perf_counter()
        self.wait()  # the stager's buffers are reused: the previous write must be finished
        # At an epoch end `epoch` counts the epochs completed (the trainer increments it before
        # saving, and a resume starts that epoch), so milestones are the ends of epochs N, 2N...
        milestone = bool(
            epoch_end and self.milestone_every and epoch > 0 and epoch % self.milestone_every == 0
        )
        meta = {"step": step, "epoch": epoch, "rank": self.rank, "world_size": self.world_size,
                "milestone": milestone, "epoch_end": epoch_end}  # fmt: skip
        meta.update(self.attempt)
        if self.elastic is not None:
            meta["global_batch"] = self.elastic.global_batch
        if not self.use_async:
            self._write(self._stage(state), meta)
            self._raise_pending()
            return
        self._staged.clear()
        if overlap:
            now = set(copy_now)
            state, host = self.stager.stage(state, only=lambda t: t.data_ptr() in now), None
        else:
            host = self._stage(state)
        self._thread = threading.Thread(
            target=self._stage_and_write, args=(state, host, meta), daemon=False
        )
        self._thread.start()
        self.last_stall_s = time.perf_counter() - start

    def fence(self) -> None:
        """Block until the pending save's host copy is complete (then the state may change)."""
        if self._staged.is_set():
            return
        start = time.perf_counter()
        self._staged.wait()
        self.last_stall_s += time.perf_counter() - start

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        host = self.stager.stage(state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return host

    def _stage_and_write(
        self, state: dict[str, Any], host: dict[str, Any] | None, meta: dict[str, Any]
    ) -> None:
        try:
            if host is None:
                host = self._stage(state)
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._staged.set()
        self._write(host, meta)

    def _write(self, host: dict[str, Any], meta: dict[str, Any]) -> None:
        try:
            directory = self.step_dir(meta["step"])
            info = atomic_torch_save(host, directory / f"rank{self.rank}.pt")
            io.write_json_atomic(
                directory / f"rank{self.rank}.json", {**meta, **info, "time": time.time()}
            )
            if self.rank == 0:
                commit.commit(directory, meta, self.world_size, self.launch, self._await_files,
                              self.commit_timeout_s)  # fmt: skip
                self._prune(directory)
        except BaseException as exc:  # surfaced on the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the pending save is durable on disk (re-raising its error, if any)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"checkpoint write failed under {self.root}: {error}; the previous "
                "checkpoints are untouched (each file is written under a temporary name and "
                "renamed only when complete, and a step counts only once committed)"
            ) from error

    def step_dirs(self) -> list[Path]:
        """Step directories, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def _prune(self, just_committed: Path) -> None:
        """Keep the newest `keep_last` complete checkpoints, the one just committed (even when a
        newer-named one exists) and every milestone; older incomplete ones go too."""
        complete = [d for d in self.step_dirs() if commit.check(d, checksums=False) is None]
        kept = {just_committed.name, *(d.name for d in complete[: self.keep_last])}
        oldest_kept = min(kept)
        for directory in self.step_dirs():
            if directory.name >= oldest_kept or self._is_milestone(directory):
                continue
            shutil.rmtree(directory, onerror=_warn_not_removed)
        discarded = self.root / DISCARDED
        for directory in sorted(discarded.glob(f"{STEP_PREFIX}*")) if discarded.is_dir() else []:
            if directory.name.split(".")[0] < just_committed.name:  # superseded by a newer save
                shutil.rmtree(directory, onerror=_warn_not_removed)

    def _is_milestone(self, directory: Path) -> bool:
        """A milestone is kept; so is a directory whose record cannot be read for another
        reason than its absence (an I/O error must not turn a milestone into garbage)."""
        for name in (commit.COMMIT, "rank0.json"):
            try:
                return bool(json.loads((directory / name).read_text()).get("milestone"))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, AttributeError) as exc:
                log.warning("keeping %s: its %s cannot be read (%s)", directory, name, exc)
                return True
        return False

    def saved_world_size(self, directory: Path) -> int | None:
        """How many ranks wrote the checkpoint (its commit marker says), None if unreadable."""
        try:
            return int(commit.read_commit(directory)["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def verify(self, directory: Path) -> str | None:
        """None if the checkpoint is complete (committed, every file present with its
        checksum), else the reason it is unusable."""
        return commit.check(directory, checksums=True)

    def latest_valid(self, exclude: Collection[str] = ()) -> Path | None:
        """Newest complete checkpoint; incomplete or corrupt ones are skipped with a warning."""
        for directory in self.step_dirs():
            if directory.name in exclude:
                continue
            reason = self.verify(directory)
            if reason is None:
                return directory
            log.warning("skipping checkpoint %s: %s", directory, reason)
        return None

    def agree_on_latest(self, exclude: Collection[str] = ()) -> Path | None:
        """Rank 0 picks (it reads the shared storage once) and tells every rank; every rank
        raises ResumeError if the pick was written by another number of ranks. Unusable
        checkpoints newer than the pick are moved aside: this job rewrites those steps."""
        choice: list[str | None] = [None, None]
        if self.rank == 0:
            found = self.latest_valid(exclude)
            choice = [str(found) if found else None, self._refusal(found) if found else None]
            if not choice[1]:
                self.discard_newer_than(found)
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        if choice[1]:
            raise ResumeError(choice[1])
        return None if choice[0] is None else Path(choice[0])

    def resume(self, resume: str, load: Callable[[Path], None], device: torch.device) -> None:
        """Load (with `load`, on every rank) the newest complete checkpoint; one that fails to
        load on any rank is moved aside and the one before it is tried, so a damaged
        checkpoint costs work, never the job. An explicit `resume` PATH is a first start's
        choice: once the run has a checkpoint of its own (a requeue), that one is resumed."""
        if resume == "none":
            return
        tried: list[str] = []
        while True:
            directory = self.agree_on_latest(exclude=tried)
            if directory is None and resume != "auto" and not tried:
                directory = self.agree_on_path(Path(resume))
            elif directory is not None and resume != "auto":
                log.info("--resume %s applies to a first start only: this run has its own "
                         "checkpoint %s", resume, directory)  # fmt: skip
            if directory is None:
                if tried:
                    log.error("no checkpoint of %s could be loaded (tried %s): starting from "
                              "step 0", self.root, ", ".join(tried))  # fmt: skip
                return
            error = _try(load, directory)
            if all_ranks_ok(error is None, device):
                return
            tried.append(directory.name)
            log.warning("checkpoint %s did not load (%s): trying the one before", directory,
                        error or "failed on another rank")  # fmt: skip
            if self.rank == 0 and directory.parent == self.root:
                self.discard(directory)

    def agree_on_path(self, directory: Path) -> Path:
        """An explicitly named checkpoint, verified and checked as an automatic pick is."""
        reason: list[str | None] = [None]
        if self.rank == 0:
            problem = self.verify(directory)
            reason[0] = f"--resume {directory}: {problem}" if problem else self._refusal(directory)
        if dist.is_initialized():
            dist.broadcast_object_list(reason, src=0)
        if reason[0]:
            raise ResumeError(reason[0])
        return directory

    def discard_newer_than(self, keep: Path | None) -> None:
        """Move step directories newer than `keep` to checkpoints/discarded/ (rank 0, before
        any rank of this start writes): a step directory never mixes two starts' files."""
        for directory in self.step_dirs():
            if keep is not None and directory.name <= keep.name:
                break
            self.discard(directory)

    def discard(self, directory: Path) -> None:
        """Move an unusable step directory aside (kept for a look until a newer save)."""
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

    def load(self, directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """(rank 0's shared training state, this rank's own state).

        Written by another world size (elastic resume): every rank takes rank 0's own state,
        whose loader position counts global samples and whose RNG each step reseeds anyway.
        Only tensors and plain containers are unpickled (weights_only).
        """
        shared = torch.load(directory / "rank0.pt", map_location="cpu", weights_only=True)
        own_file = directory / f"rank{self.rank}.pt"
        resized = self.saved_world_size(directory) != self.world_size
        own = (
            shared
            if self.rank == 0 or resized
            else torch.load(own_file, map_location="cpu", weights_only=True)
        )
        return shared, own

    def close(self) -> None:
        self.wait()


def _try(load: Callable[[Path], None], directory: Path) -> str | None:
    try:
        load(directory)
    except ResumeError:
        raise
    except Exception as exc:  # a damaged file the checksums did not catch, a bad format
        return f"{type(exc).__name__}: {exc}"
    return None


def _agreed_launch_id() -> str:
    """One id for this start of the job, the same on every rank (rank 0's)."""
    launch = [commit.new_launch_id()]
    if dist.is_initialized():
        dist.broadcast_object_list(launch, src=0)
    return str(launch[0])


def _warn_not_removed(function: Any, path: str, excinfo: Any) -> None:
    # A checkpoint left behind only costs disk space: say so, and keep training.
    del function
    log.warning("checkpoint pruning could not remove %s: %s", path, excinfo[1])


def save_final(
    run_dir: Path, model_state: dict[str, torch.Tensor], manifest: dict[str, Any],
    data: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """RUN_DIR/final/model.pt, the timm folder's files (timm_folder.py; `data`: the eval
    preprocessing) and manifest.json (written last, so its presence means complete)."""
    model_file = runfiles.final_model(run_dir)
    state = {k: v.detach().cpu() for k, v in model_state.items()}
    info = atomic_torch_save(state, model_file)
    timm = timm_folder.write(model_file.parent, state, manifest["model"], manifest["img_size"],
                             manifest["num_classes"], data or {})  # fmt: skip
    io.write_json_atomic(model_file.parent / runfiles.MANIFEST, {**manifest, **info, "timm": timm})
    return model_file
