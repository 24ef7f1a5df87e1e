"""Per-rank JSONL metrics, TensorBoard scalars and W&B (rank 0), a progress bar or plain lines."""

from __future__ import annotations

import json
import logging
import os
import resource
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vitpod.registry import io, runfiles

log = logging.getLogger(__name__)
PHASES = ("data", "compute", "comm", "optimizer", "step", "sync")
# "sync": what this rank waited for the others outside the gradient exchange (DDP's buffer
# broadcast before the forward, the step boundary's agreement), inside data and compute: a step
# minus comm and sync is the rank's own time, which names stragglers (analysis/stragglers.py).


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU, else the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def topk_counts(
    logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...] = (1, 5)
) -> torch.Tensor:
    """Number of samples whose target is among the top-k logits, for each k (on the device)."""
    maxk = min(max(ks), logits.shape[1])
    top = logits.topk(maxk, dim=1).indices
    hits = top.eq(targets.view(-1, 1))
    return torch.stack([hits[:, : min(k, maxk)].any(dim=1).sum() for k in ks])


def topk_correct(
    logits: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...] = (1, 5)
) -> list[int]:
    """Number of samples whose target is among the top-k logits, for each k."""
    return [int(v) for v in topk_counts(logits, targets, ks).tolist()]


class StepTimer:
    """Wall-clock phases of one optimizer step; with `sync`, CUDA-synchronised at each phase so
    GPU time is not misplaced (without it the phases time the host's dispatch only)."""

    current: StepTimer | None = None
    """The newest timer: the one watch_forward_sync's hook adds to."""

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = device
        self.sync = sync and device.type == "cuda"
        self.times = dict.fromkeys(PHASES, 0.0)
        self._mark = time.perf_counter()
        StepTimer.current = self

    def waited(self, collective: Callable[..., Any], *args: Any) -> Any:
        """`collective(*args)`: its time is this rank's wait for the others (times["sync"])."""
        start = time.perf_counter()
        try:
            return collective(*args)
        finally:
            self.times["sync"] += time.perf_counter() - start

    def forward_started(self) -> None:
        """The model's own forward begins: the time since the last lap was DDP's buffer sync."""
        self.times["sync"] += time.perf_counter() - self._mark

    def lap(self, phase: str) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[phase] += now - self._mark
        self._mark = now

    def finish(self, comm_s: float) -> dict[str, float]:
        self.times["comm"] = comm_s
        self.times["step"] = sum(self.times[p] for p in ("data", "compute", "optimizer"))
        return dict(self.times)


def watch_forward_sync(engine: Any) -> None:
    """DDP engines: time the buffer broadcast DDP runs before each training forward, which waits
    for the slowest rank (a forward pre-hook on the model DDP wraps runs after it)."""
    if getattr(engine, "ddp", None) is None:
        return

    def started(module: Any, args: Any) -> None:
        if module.training and StepTimer.current is not None:
            StepTimer.current.forward_started()

    engine.model.register_forward_pre_hook(started)


WANDB_ID_FILE = "wandb-run-id"  # in RUN_DIR: a requeued job continues the same W&B run


def _wandb_run(run_dir: Path, config: dict[str, Any]) -> Any:
    """Start (or resume, after a requeue) the W&B run of this run directory.

    Project, entity and name come from the flags, else W&B's own variables (WANDB_PROJECT,
    WANDB_ENTITY, WANDB_NAME, which a cluster profile sets under `env:`), else vitpod / W&B's
    default entity / the run directory's name. `dir=RUN_DIR` puts W&B's files, and with
    WANDB_MODE=offline the whole run (RUN_DIR/wandb/offline-run-*; `wandb sync` uploads it),
    beside the run. Online, the key comes from WANDB_API_KEY, which profiles list under
    `secrets:` so it reaches the container by name. https://docs.wandb.ai/ref/python/init and
    https://docs.wandb.ai/guides/track/environment-variables
    """
    try:
        import wandb  # lazily: only runs given --log-wandb need it
    except ImportError:
        from vitpod.trainer.config import ConfigError

        raise ConfigError(
            "--log-wandb: the wandb package is not installed; pip install wandb or drop the flag"
        ) from None
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    try:
        return wandb.init(
            project=config.get("wandb_project") or os.environ.get("WANDB_PROJECT") or "vitpod",
            entity=config.get("wandb_entity") or None,  # None: W&B reads WANDB_ENTITY itself
            name=config.get("wandb_name") or os.environ.get("WANDB_NAME") or run_dir.name,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
        )
    except Exception as exc:  # wandb raises its own types (UsageError, CommError, ...)
        from vitpod.trainer.config import ConfigError

        raise ConfigError(
            f"--log-wandb: W&B did not start ({exc}). Online runs need WANDB_API_KEY (list it "
            "under the profile's `secrets:` and export it where you submit); WANDB_MODE=offline "
            "logs into the run directory without an account"
        ) from exc


class MetricsLogger:
    """Writes RUN_DIR/metrics/rank{R}.jsonl on every rank; TensorBoard, W&B (with --log-wandb)
    and the console on rank 0. `config` is the resolved trainer config (W&B records it)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, total_steps: int,
                 log_interval: int, device: torch.device,
                 config: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.total_steps = total_steps
        self.log_interval = max(1, log_interval)
        path = runfiles.metrics_file(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        runfiles.drop_torn_tail(path)  # a killed start's half line (runfiles' policy)
        self.file = open(path, "a", buffering=1)  # line-buffered: a killed job keeps its lines
        self.tb = self._tensorboard(Path(run_dir) / runfiles.TENSORBOARD) if rank == 0 else None
        self.bar = self._bar(total_steps) if rank == 0 and sys.stderr.isatty() else None
        config = config or {}
        wanted = rank == 0 and bool(config.get("log_wandb"))
        self.wandb = _wandb_run(Path(run_dir), config) if wanted else None

    @staticmethod
    def _tensorboard(path: Path):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(path))

    @staticmethod
    def _bar(total: int):
        from tqdm import tqdm

        return tqdm(total=total, dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")

    def step(self, step: int, epoch: int, batch_size: int, loss: float, lr: float,
             times: dict[str, float], warmup: bool,
             ended: float | None = None, **extra: Any) -> None:  # fmt: skip
        rate = batch_size / times["step"] if times["step"] > 0 else 0.0
        peak = peak_memory_bytes(self.device)
        # total_steps and the time the step ended (stamped at the step, written at the flush)
        # let `make status FOLLOW=1` show progress and ETA, and the goodput ledger its parts.
        record = {
            "kind": "step", "step": step, "epoch": epoch, "rank": self.rank,
            "world_size": self.world_size, "batch_size": batch_size, "loss": loss, "lr": lr,
            "images_per_s": rate, "time": times, "peak_mem_bytes": peak,
            "warmup": warmup, "total_steps": self.total_steps,
            "wall_time": time.time() if ended is None else ended, **extra,
        }  # fmt: skip
        self.write(record)
        if self.rank != 0:
            return
        if self.tb is not None:
            for name, value in (("loss", loss), ("lr", lr), ("images_per_s", rate)):
                self.tb.add_scalar(f"train/{name}", value, step)
        if self.wandb is not None:
            # The JSONL step line's numbers under TensorBoard-style names.
            logged: dict[str, float] = {
                "train/loss": loss, "train/lr": lr, "train/epoch": epoch,
                "train/images_per_s": rate, "train/warmup": int(warmup),
                "train/peak_mem_bytes": peak,
            }  # fmt: skip
            logged.update({f"time/{k}": v for k, v in times.items()})
            self.wandb.log(logged, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", ips=f"{rate:.0f}")
        elif step % self.log_interval == 0:
            log.info(
                "epoch %d step %d loss %.4f lr %.3e %.1f img/s/rank", epoch, step, loss, lr, rate
            )

    def eval(self, epoch: int, step: int, top1: float, top5: float, loss: float) -> None:
        self.write(
            {"kind": "eval", "epoch": epoch, "step": step, "top1": top1, "top5": top5, "loss": loss}
        )
        if self.rank == 0:
            log.info("epoch %d eval top1 %.2f top5 %.2f loss %.4f", epoch, top1, top5, loss)
            if self.tb is not None:
                for name, value in (("top1", top1), ("top5", top5), ("loss", loss)):
                    self.tb.add_scalar(f"eval/{name}", value, step)
            if self.wandb is not None:
                # The step-logging call for `step` already went out: commit with the same step.
                self.wandb.log({"eval/top1": top1, "eval/top5": top5, "eval/loss": loss}, step=step)

    def summary(self, record: dict[str, Any], run_dir: Path) -> None:
        """Rank 0: the summary line and RUN_DIR/summary.json."""

        record = {"kind": "summary", **record}
        self.write(record)
        io.write_json_atomic(Path(run_dir) / runfiles.SUMMARY, record)
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in record.items() if k != "kind"})
        log.info("summary %s", json.dumps(record))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.file.close()
