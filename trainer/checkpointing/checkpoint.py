"""Async, atomic, verified checkpoints: the host copy overlaps the next forward/backward."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vitpod.registry import io, records, runfiles, safepickle
from vitpod.trainer.checkpointing import checkpoint_commit as commit
from vitpod.trainer.checkpointing import elastic as elastic_rules
from vitpod.trainer.checkpointing import reads, timm_folder
from vitpod.trainer.checkpointing.host_stage import HostStager
from vitpod.trainer.checkpointing.resume import STEP_PREFIX, ResumeVerdicts
from vitpod.trainer.checkpointing.resume import ResumeError as ResumeError
from vitpod.trainer.checkpointing.resume import StorageError as StorageError
from vitpod.trainer.checkpointing.resume import engine_state as engine_state
from vitpod.trainer.checkpointing.resume import run_settings as run_settings
from vitpod.trainer.checkpointing.torchsave import atomic_torch_save

log = logging.getLogger(__name__)


class Checkpointer(ResumeVerdicts):
    """save (async) / wait / latest_valid / load over RUN_DIR/checkpoints/step_N/rank{R}.pt."""

    def __init__(self, root: Path, rank: int, world_size: int, keep_last: int = 3,
                 milestone_every: int = 0, use_async: bool = True,
                 elastic: elastic_rules.Resize | None = None,
                 await_files: Collection[str] = (), commit_timeout_s: float = 1800.0,
                 launch: str | None = None, settings: dict[str, Any] | None = None,
                 ) -> None:  # fmt: skip
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
        self.settings = dict(settings or {})  # recorded in every checkpoint, compared at resume
        self._saves = 0  # this start's save sequence number, the same on every rank
        self._written: set[int] = set()  # steps this start saved or resumed: written once

    def written(self, step: int) -> bool:
        """Whether this start already holds `step` (saved it, or resumed from it)."""
        return step in self._written

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
        if self.written(step):  # a step is written once per start, never rewritten in place
            log.info("step %d is already checkpointed by this start: not saved again", step)
            self.last_stall_s = time.perf_counter() - start
            return
        self._written.add(step)
        self._saves += 1
        # At an epoch end `epoch` counts the epochs completed (the trainer increments it before
        # saving, and a resume starts that epoch), so milestones are the ends of epochs N, 2N...
        milestone = bool(
            epoch_end and self.milestone_every and epoch > 0 and epoch % self.milestone_every == 0
        )
        meta: dict[str, Any] = {"step": step, "epoch": epoch, "rank": self.rank,
                                "world_size": self.world_size, "milestone": milestone,
                                "epoch_end": epoch_end}  # fmt: skip
        meta.update(self.attempt, save=self._saves)
        if self.settings:
            meta["settings"] = self.settings
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
        """Step directories (`step_<9 digits>` only), newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if runfiles.is_checkpoint_name(p.name)]
        found = [p for p in found if p.is_dir()]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def _prune(self, just_committed: Path) -> None:
        """Keep the newest `keep_last` complete checkpoints, the one just committed (even when a
        newer-named one exists) and every milestone; older incomplete ones go too. Nothing
        else under the root is touched (discarded/, a user's `step_backup`)."""
        complete = [d for d in self.step_dirs() if _complete(d)]
        kept = {just_committed.name, *(d.name for d in complete[: self.keep_last])}
        oldest_kept = min(kept)
        for directory in self.step_dirs():
            if directory.name >= oldest_kept or self._is_milestone(directory):
                continue
            shutil.rmtree(directory, onerror=_warn_not_removed)

    def _is_milestone(self, directory: Path) -> bool:
        """A milestone is kept; so is a directory whose record cannot be read for another
        reason than its absence (an I/O error must not turn a milestone into garbage)."""
        for name in (commit.COMMIT, "rank0.json"):
            try:
                return bool(json.loads(reads.read_text(directory / name)).get("milestone"))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, AttributeError) as exc:
                log.warning("keeping %s: its %s cannot be read (%s)", directory, name, exc)
                return True
        return False

    def load(self, directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """(rank 0's shared training state, this rank's own state).

        Written by another world size (elastic resume): every rank takes rank 0's own state,
        whose loader position counts global samples and whose RNG each step reseeds anyway.
        Only tensors and plain containers are unpickled (weights_only).
        """
        shared = _torch_load(directory / "rank0.pt")
        own_file = directory / f"rank{self.rank}.pt"
        resized = self.saved_world_size(directory) != self.world_size
        own = shared if self.rank == 0 or resized else _torch_load(own_file)
        return shared, own

    def close(self) -> None:
        self.wait()


def _complete(directory: Path) -> bool:
    """Rotation's cheap test; a storage error counts as not complete (so it keeps more)."""
    try:
        return commit.check(directory, checksums=False) is None
    except OSError:
        return False


def _torch_load(path: Path) -> Any:
    with reads.open_read(path) as fh, safepickle.naming(path):  # a refusal names the file
        return torch.load(fh, map_location="cpu", weights_only=True)


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
    preprocessing) and model.json (registry.records.FinalModel; written last, so its presence
    means complete)."""
    model_file = runfiles.final_model(run_dir)
    state = {k: v.detach().cpu() for k, v in model_state.items()}
    info = atomic_torch_save(state, model_file)
    timm = timm_folder.write(model_file.parent, state, manifest["model"], manifest["img_size"],
                             manifest["num_classes"], data or {})  # fmt: skip
    records.write(model_file.parent, runfiles.FINAL_RECORD, {**manifest, **info, "timm": timm})
    return model_file
