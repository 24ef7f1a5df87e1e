"""Speed options applied before parallelize: --outlook-kernel, --fp8, --compile and its cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from vitpod.trainer.config import TrainConfig
from vitpod.trainer.speed.compile_cache import compile_enabled, use_run_cache
from vitpod.trainer.speed.fp8 import apply_fp8
from vitpod.trainer.speed.outlook import apply_outlook_kernel
from vitpod.trainer.telemetry.mfu import Mfu, measure_on_meta

log = logging.getLogger(__name__)


def apply_speedups(model: nn.Module, cfg: TrainConfig, device: torch.device, run_dir: Path) -> bool:
    """Swap kernels in place; returns whether to compile (its cache is then set up)."""
    if apply_outlook_kernel(model, cfg.outlook_kernel, device):  # triton: refused off CUDA
        log.info("--outlook-kernel %s: outlook attention without unfold/fold", cfg.outlook_kernel)
    if cfg.fp8:
        apply_fp8(model, device)  # raises on hardware without float8, before any step
    compile_model = compile_enabled(cfg.compile, device)
    if compile_model:
        decisions = {
            "model": cfg.model, "img_size": cfg.img_size, "batch_size": cfg.batch_size,
            "amp": cfg.use_amp, "amp_dtype": cfg.amp_dtype, "channels_last": cfg.channels_last,
            "fp8": cfg.fp8, "outlook_kernel": cfg.outlook_kernel, "attn": cfg.attn,
            "drop_path": cfg.drop_path, "world_size": cfg.world_size, "fsdp": cfg.fsdp,
            "tp": cfg.tp, "pp": cfg.pp, "deepspeed": cfg.deepspeed,
        }  # fmt: skip
        path = use_run_cache(run_dir, decisions, device)
        log.info("--compile %s: on; inductor caches in %s", cfg.compile, path)
    return compile_model


def startup_mfu(cfg: TrainConfig, classes: int, device: torch.device) -> Mfu:
    """This run's FLOPs per step (counted on the meta device) and the device's peak."""
    samples = cfg.batch_size * cfg.accum_steps
    try:
        dtype = cfg.amp_dtype if cfg.use_amp else "fp32"
        return measure_on_meta(
            cfg.model, cfg.img_size, classes, device, samples, cfg.tp * cfg.pp, dtype
        )
    except (RuntimeError, NotImplementedError, TypeError) as err:  # MFU never stops a run
        log.warning("MFU not computed: the flop count failed (%s)", err)
        return Mfu(0, 0, None, "", f"flop count failed: {err}")
