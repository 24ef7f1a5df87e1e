"""The Trainer, built in order: dist, model, parallelize, optimizer, data, LR, checkpoints."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vitpod.registry import io, runfiles
from vitpod.trainer import dist as tdist
from vitpod.trainer.checkpointing import checkpoint as ckpt
from vitpod.trainer.checkpointing.elastic import Resize, restore_position
from vitpod.trainer.checkpointing.preempt import Preemption
from vitpod.trainer.checkpointing.rng import (
    reseed_for_step,
    rng_state,
    seed_everything,
    set_rng_state,
)
from vitpod.trainer.checkpointing.timm_folder import preprocessing
from vitpod.trainer.config import TrainConfig
from vitpod.trainer.engines.engine import Engine
from vitpod.trainer.engines.mesh import job_images_per_s, local_param_bytes, max_over_ranks
from vitpod.trainer.engines.parallel import parallelize
from vitpod.trainer.evaluate import evaluate
from vitpod.trainer.exitcodes import OK, REQUEUE
from vitpod.trainer.model.components import (
    data_config,
    make_criterion,
    make_mixup,
    num_classes,
    resolve_num_classes,
)
from vitpod.trainer.model.ema import load_ema, make_ema, save_final_ema
from vitpod.trainer.model.models import build_model, model_manifest
from vitpod.trainer.model.optim import current_lr, optimizer_for, schedule_for
from vitpod.trainer.settings.timmargs import args_yaml
from vitpod.trainer.speed.attention import choose_kernel
from vitpod.trainer.speed.precision import make_precision, prepare_model
from vitpod.trainer.speed.speedups import apply_speedups, startup_mfu
from vitpod.trainer.telemetry.heartbeat import Heartbeat
from vitpod.trainer.telemetry.metrics import MetricsLogger, StepTimer, watch_forward_sync
from vitpod.trainer.telemetry.sample_digest import StepSamples
from vitpod.trainer.telemetry.timing import TimingLog

log = logging.getLogger(__name__)


class Trainer:
    """One rank of a training run; `run()` returns an exit status from vitpod.trainer.exitcodes."""

    def __init__(
        self, cfg: TrainConfig, env: tdist.DistEnv, preemption: Preemption | None = None
    ) -> None:
        self.cfg, self.env = cfg, env
        self.run_dir = Path(cfg.output)
        self.heartbeat = Heartbeat.from_env(self.run_dir, env.rank)  # job.sbatch's watchdog
        self.device = tdist.init(env)
        seed_everything(cfg.seed)
        resolve_num_classes(cfg)
        self.model = self._build_model()
        self.precision = make_precision(
            self.device, cfg.amp, cfg.apex_amp, cfg.amp_dtype, cfg.channels_last
        )
        self.attention = choose_kernel(self.model, cfg.attn, self.device, self.precision.dtype)
        self.heartbeat.compiled = apply_speedups(self.model, cfg, self.device, self.run_dir)
        self.model = prepare_model(self.model, self.precision, self.heartbeat.compiled)
        self.criterion = make_criterion(cfg)
        self.engine: Engine = parallelize(
            self.model, self._optimizer, self.precision, cfg, loss_fn=self.criterion
        )
        self.model = self.engine.model  # a pipeline stage or sharded module replaces the model
        watch_forward_sync(self.engine)  # stragglers: a rank's wait for the others
        self.mixup, self.ema = make_mixup(cfg), make_ema(cfg, self.model)
        mesh = getattr(self.engine, "mesh", None)
        # Ranks of one model replica (tp x pp) read the same samples and share dropout masks.
        self.data_rank: int
        self.data_world: int
        self.data_rank, self.data_world = (
            (mesh.dp_rank, mesh.shape.dp) if mesh else (env.rank, env.world_size)
        )
        self.mesh_shape = mesh.shape.as_dict() if mesh else {"dp": env.world_size, "tp": 1, "pp": 1}
        self.train_loader, self.val_loader = self._build_data()
        self.steps_per_epoch = max(1, len(self.train_loader) // cfg.accum_steps)
        self.scheduler = schedule_for(self.engine.optimizer, cfg, self.steps_per_epoch)
        self.checkpointer = ckpt.Checkpointer(
            self.run_dir / runfiles.CHECKPOINTS, env.rank, env.world_size, cfg.keep_last,
            cfg.milestone_every, elastic=Resize(cfg.global_batch_size, self.engine.name),
            await_files=self.engine.sharded_files,
            settings=ckpt.run_settings(cfg, num_classes(cfg), self.engine.name),
        )  # fmt: skip
        total = cfg.max_steps or self.steps_per_epoch * cfg.train_epochs
        self.metrics = MetricsLogger(
            self.run_dir, env.rank, env.world_size, total, cfg.log_interval, self.device,
            config=cfg.record(),
        )  # fmt: skip
        self.mfu = startup_mfu(cfg, num_classes(cfg), self.device) if env.is_main else None
        if self.mfu is not None:
            self.metrics.write(self.mfu.record())
        self.timing = TimingLog(self.metrics.write, self.heartbeat)
        self.preemption = preemption or Preemption()
        self.step, self.epoch = 0, 0
        self.eval_pending = False  # a checkpoint at an epoch's end taken before its evaluation
        self.last_eval: dict[str, float] = {}
        self.throughput = {"images": 0.0, "seconds": 0.0}
        self.steps_this_process = 0
        self._pending: list[tuple[int, int, int, torch.Tensor, float, dict, bool, float]] = []
        self.log_every = max(1, cfg.log_interval)
        self.samples = StepSamples(self.data_rank) if cfg.log_sample_ids else None
        self._digests: dict[int, dict[str, Any]] = {}

    def _build_model(self) -> nn.Module:
        return build_model(self.cfg, num_classes(self.cfg), self.device, self.env.world_size)

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer_for(model, self.cfg, self.device)

    def _build_data(self):
        from vitpod.trainer.data import create_loader

        data_cfg = data_config(self.cfg)
        rank, world = self.data_rank, self.data_world
        batch = self.cfg.validation_batch_size or data_cfg.batch_size  # timm's -vb
        val_cfg = dataclasses.replace(data_cfg, token_label=False, aug_repeats=0, batch_size=batch)
        return (
            create_loader(data_cfg, "train", rank, world),
            create_loader(val_cfg, "val", rank, world),
        )

    # ----------------------------------------------------------------------------- the loop
    def run(self) -> int:
        cfg = self.cfg
        self.preemption.install()  # main() installed it already; again for Trainers built directly
        self.checkpointer.resume(cfg.resume, self._load, self.device)  # refused: nothing written
        if self.env.is_main:
            io.write_json_atomic(_mkdir(self.run_dir) / runfiles.CONFIG, cfg.record())
            io.write_text_atomic(self.run_dir / runfiles.ARGS, args_yaml(cfg, data_config(cfg)))
        if self.eval_pending:  # the epoch before ended in the preempted start
            self._evaluate(self.epoch - 1)
        self.timing.start(self.step)
        if self.preemption.agreed(self.step):  # signalled during startup, before any step here
            self.timing.end(self.step, "preempted")
            return self._requeue_before_training()
        if cfg.checkpoint_steps:
            self.checkpointer.preallocate(self._state(epoch_end=False))
        while self.epoch < cfg.train_epochs and not self._reached_max_steps():
            self.train_loader.set_epoch(self.epoch)
            if self._train_epoch() == "preempted":
                # At an epoch's last step this is the epoch's end (evaluated by the next start).
                if epoch_end := self._epoch_ends_here():
                    self.epoch, self.eval_pending = self.epoch + 1, self.cfg.eval
                self._save(epoch_end=epoch_end, wait=True)
                self.timing.end(self.step, "preempted")
                log.warning(
                    "preempted (%s): checkpointed at step %d",
                    self.preemption.signal_name,
                    self.step,
                )
                return REQUEUE
            if not self._reached_max_steps():  # a run cut by --max-steps ends without an epoch end
                self._evaluate()
                self.epoch += 1
                self._save(epoch_end=True)
        with self.heartbeat.during("checkpoint", self.step):
            self._finish()
        self.timing.end(self.step, "finished")
        return OK

    def _requeue_before_training(self) -> int:
        """Nothing new to save: the resumed checkpoint (if any) already holds this state."""
        log.warning(
            "preempted (%s) before the first step; state is step %d (%s)",
            self.preemption.signal_name or "another rank",
            self.step,
            "already checkpointed" if self.step else "nothing to save",
        )
        return REQUEUE

    def _train_epoch(self) -> str:
        cfg, engine = self.cfg, self.engine
        self.model.train()
        timer, micro = self._timer(), 0
        for images, targets in self.heartbeat.batches(self.train_loader, lambda: self.step):
            timer.lap("data")
            reseed_for_step(cfg.seed, self.data_rank, self.step, micro)
            last = micro + 1 == cfg.accum_steps
            images = self.precision.prepare_input(images)
            targets = _to_device(targets, self.device)
            if self.mixup is not None:  # after the reseed: the step's own mix
                images, targets = self.mixup(images, targets)
            if engine.pipelined:  # the step's micro-batches, all full (--pp implies --drop-last)
                with self.precision.autocast():
                    loss = engine.pipeline_micro(images, targets, last)
            else:
                with engine.micro_step(last), self.precision.autocast():
                    loss = self.criterion(engine.forward(images), targets)
                engine.backward(loss)
            timer.lap("compute")
            if self.samples is not None:  # a pipeline's losses are known after its last batch
                self.samples.add(self.train_loader.last_indices, None if engine.pipelined else loss)
                if engine.pipelined and last:
                    self.samples.add_losses(engine.batch_losses)
            micro += 1
            if not last:
                continue
            self.scheduler.step_update(num_updates=self.step)
            # A checkpoint's host copy must finish before the parameters change.
            self.timing.fence(self.checkpointer.fence)
            engine.step()
            if self.ema is not None:
                self.ema.update(self.model, step=self.step + 1)
            timer.lap("optimizer")
            if self.samples is not None:
                self._digests[self.step + 1] = self.samples.digest()
            self._record_step(loss.detach(), timer.finish(engine.comm_seconds()))
            micro, timer = 0, self._timer()
            if timer.waited(self.preemption.agreed, self.step):  # the next step's wait
                self._flush_steps()
                return "preempted"
            due = cfg.checkpoint_steps and self.step % cfg.checkpoint_steps == 0
            if due and not self._epoch_ends_here():  # else the epoch's end saves this step
                self._flush_steps()
                self._save(epoch_end=False, overlap=True)
            if self._reached_max_steps():
                self._flush_steps()
                return "max_steps"
        engine.optimizer.zero_grad(set_to_none=True)  # an incomplete accumulation is dropped
        if self.samples is not None:
            self.samples.clear()
        if engine.pipelined:
            engine.discard_partial()
        self._flush_steps()
        return "epoch_end"

    def _timer(self) -> StepTimer:
        # A CUDA synchronize per phase would stall the host every step; only the steps that end
        # a log interval are timed exactly (the others time the host, the GPU catches up later).
        return StepTimer(self.device, sync=(self.step + 1) % self.log_every == 0)

    def _record_step(self, loss: torch.Tensor, times: dict[str, float]) -> None:
        ended = time.time()  # the step's end on the host (no device sync), written at the flush
        times["checkpoint_wait"] = self.timing.take_fence_s()
        cfg = self.cfg
        self.step += 1
        self.heartbeat.stepped(self.step)
        # Counted per process, so the warm-up after a restart is left out too.
        warmup = self.steps_this_process < cfg.warmup_steps_excluded
        self.steps_this_process += 1
        images = cfg.batch_size * cfg.accum_steps
        if not warmup:
            # The tp x pp ranks of one replica share its images: each is counted once in total.
            self.throughput["images"] += images * self.data_world / self.env.world_size
            self.throughput["seconds"] += times["step"]
        lr = current_lr(self.engine.optimizer)
        self._pending.append((self.step, self.epoch, images, loss, lr, times, warmup, ended))
        if self.step % self.log_every == 0:
            self._flush_steps()

    def _flush_steps(self) -> None:
        """Write the buffered steps' records with one device-to-host copy of their losses.

        `loss.item()` every step is a host sync per step on a GPU (the PyTorch performance
        tuning guide: avoid unnecessary CPU-GPU synchronization); the losses stay on the
        device until a log interval, a checkpoint or the end of the epoch, and every step
        still gets its own exact loss in metrics/rank<R>.jsonl.
        """
        if not self._pending:
            return
        losses = torch.stack([p[3] for p in self._pending]).float().tolist()
        for record, loss in zip(self._pending, losses, strict=True):
            step, epoch, images, _, lr, times, warmup, ended = record
            extra = self._digests.pop(step, {})
            self.metrics.step(step, epoch, images, loss, lr, times, warmup, ended, **extra)
        self._pending.clear()

    def _reached_max_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def _epoch_ends_here(self) -> bool:
        """The step just done was the epoch's last, and the epoch's end follows it."""
        return self.train_loader.at_epoch_end() and not self._reached_max_steps()

    def _evaluate(self, epoch: int | None = None) -> None:
        self.eval_pending = False
        if self.cfg.eval:
            with self.timing.timed("eval", self.step):
                self.last_eval = evaluate(self.engine, self.val_loader, self.precision, self.device)
            self.metrics.eval(self.epoch if epoch is None else epoch, self.step, **self.last_eval)

    # ----------------------------------------------------------------------------- state
    def _state(self, epoch_end: bool) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step, "epoch": self.epoch, "epoch_end": epoch_end,
            "rng": rng_state(), "loader": self.train_loader.state_dict(),
            "mesh": self.mesh_shape, "eval_pending": self.eval_pending,
        }  # fmt: skip
        if self.env.is_main:
            state.update(self.engine.state_dict(), scheduler=self.scheduler.state_dict())
            if self.ema is not None:
                state["ema"] = self.ema.module.state_dict()
        return state

    def _save(self, epoch_end: bool, wait: bool = False, overlap: bool = False) -> None:
        with self.timing.timed("checkpoint", self.step):
            self._save_now(epoch_end, wait, overlap)

    def _save_now(self, epoch_end: bool, wait: bool, overlap: bool) -> None:
        if not self.checkpointer.written(self.step):  # a step is written once per start
            self.engine.save_sharded(self.checkpointer.step_dir(self.step))
            state = self._state(epoch_end)
            # Buffers (BatchNorm running stats) change in the forward: copied before it runs.
            buffers = {b.data_ptr() for b in self.engine.model.buffers()}
            self.checkpointer.save(self.step, self.epoch, state, epoch_end, overlap=overlap,
                                   copy_now=buffers)  # fmt: skip
        if wait:
            self.checkpointer.wait()
            self.engine.wait_sharded()

    def _load(self, directory: Path) -> None:
        cfg = self.cfg
        shared, own = self.checkpointer.load(directory)
        self.engine.load_state_dict(shared)
        self.engine.load_sharded(directory)
        self.scheduler.load_state_dict(shared["scheduler"])
        if self.ema is not None:
            load_ema(self.ema, shared, self.model)
        self.step, self.epoch = own["step"], own["epoch"]
        self.eval_pending = bool(own.get("eval_pending"))
        restore_position(self.train_loader, own, cfg.global_batch_size)
        if own.get("mesh", self.mesh_shape) != self.mesh_shape:  # read by status and goodput
            self.metrics.write({"kind": "resize", "step": self.step, "from": own["mesh"],
                                "to": self.mesh_shape, "world_size": cfg.world_size})  # fmt: skip
        set_rng_state(own["rng"])
        log.info("resumed from %s: step %d, epoch %d", directory, self.step, self.epoch)

    def _finish(self) -> None:
        with self.timing.timed("checkpoint", self.step):
            self.checkpointer.wait()
            self.engine.wait_sharded()
        if not self.last_eval:
            self._evaluate()
        param_bytes = max_over_ranks(local_param_bytes(self.engine.model), self.device)
        model_state = self.engine.full_state_dict()  # collective for sharded engines
        ips = job_images_per_s(self.throughput["images"], self.throughput["seconds"], self.device)
        corrupt = self._corrupt_images()
        if self.env.is_main:
            cfg = self.cfg
            manifest = model_manifest(cfg.model, cfg.img_size, num_classes(cfg))
            manifest.update(step=self.step, epoch=self.epoch, **self.last_eval)
            if self.ema is not None:
                manifest["ema"] = save_final_ema(self.run_dir, self.ema)
            if model_state is None:  # every engine gathers the whole model on rank 0
                raise RuntimeError("rank 0 received no model state")
            ckpt.save_final(self.run_dir, model_state, manifest, preprocessing(data_config(cfg)))
            self.metrics.summary(
                {
                    "top1": self.last_eval.get("top1"), "top5": self.last_eval.get("top5"),
                    "steps": self.step, "images_per_s": ips,
                    "world_size": self.env.world_size, "global_batch": cfg.global_batch_size,
                    "engine": self.engine.name, "attention": self.attention,
                    "corrupt_images": corrupt,
                    "token_labels": getattr(self.train_loader, "token_label_info", None),
                    "mesh": self.mesh_shape, "param_bytes_per_rank": int(param_bytes),
                    **(self.mfu.summary(ips, self.env.world_size) if self.mfu else {}),
                },
                self.run_dir,
            )  # fmt: skip

    def _corrupt_images(self) -> int:
        """Distinct corrupt files skipped by any rank (shards change each epoch, so one file may
        have been met by several ranks); each rank's own list goes to its metrics file."""
        own = sorted(self.train_loader.corrupt_files | self.val_loader.corrupt_files)
        self.metrics.write({"kind": "corrupt", "rank": self.env.rank, "files": own})
        every: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(every, own)
        return len(set().union(*every))

    def close(self) -> None:
        """Flush checkpoints and metrics, release DDP/optimizer objects, leave the group."""
        self.checkpointer.close()
        self.metrics.close()
        del self.engine, self.model, self.scheduler, self.train_loader, self.val_loader
        tdist.teardown()


def _to_device(targets: Any, device: torch.device) -> Any:
    if isinstance(targets, torch.Tensor):
        return targets.to(device, non_blocking=True)
    return targets


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
