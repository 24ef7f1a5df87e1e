"""AdamW/LAMB with weight-decay groups, the fastest available implementation, warmup + cosine LR."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from timm.scheduler import create_scheduler_v2
from torch import nn

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No decay on norms, biases (1-d) and the model's no_weight_decay() names (pos embeddings)."""
    names = getattr(model, "no_weight_decay", None)
    skip = set(names()) if callable(names) else set()
    return param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip)


def _apex_available() -> bool:
    try:
        importlib.import_module("apex.optimizers")
    except ImportError:
        return False
    return True


def choose_implementation(opt: str, device: torch.device) -> str:
    """apex FusedAdam/FusedLAMB (when apex imports, GPU) -> torch fused -> foreach."""
    if device.type == "cuda" and _apex_available():
        return f"apex fused{opt.removesuffix('w')}"
    if opt == "adamw":
        return "torch fused"
    return "foreach"


def create_optimizer(
    model: nn.Module, opt: str, lr: float, weight_decay: float, device: torch.device
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer and the name of the implementation chosen (logged once)."""
    impl = choose_implementation(opt, device)
    groups = param_groups(model, weight_decay)
    if impl.startswith("apex"):
        optimizer = create_optimizer_v2(
            groups, opt=impl.split()[1], lr=lr, weight_decay=weight_decay
        )
    elif impl == "torch fused":
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=True)
    else:
        optimizer = create_optimizer_v2(
            groups, opt=opt, lr=lr, weight_decay=weight_decay, foreach=True
        )
    log.info("optimizer %s: %s implementation", opt, impl)
    return optimizer, impl


def create_schedule(
    optimizer: torch.optim.Optimizer,
    epochs: int,
    warmup_epochs: int,
    warmup_lr: float,
    min_lr: float,
    steps_per_epoch: int,
):
    """timm warmup + cosine, stepped per optimizer update (`step_update(global_step)`)."""
    scheduler, _ = create_scheduler_v2(
        optimizer, sched="cosine", num_epochs=epochs, warmup_epochs=warmup_epochs,
        warmup_lr=warmup_lr, min_lr=min_lr, step_on_epochs=False,
        updates_per_epoch=max(1, steps_per_epoch),
    )  # fmt: skip
    return scheduler


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def match_state_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give each per-parameter state tensor its parameter's memory layout, after a load.

    torch's fused AdamW pairs a parameter's elements with its moments' by memory offset: a
    contiguous moment beside a channels_last conv weight (as checkpoints written before the
    stager kept strides hold them) updated the wrong elements (measured: 0.16 off after one
    step at lr 0.1, where the single-tensor AdamW was exact).
    """
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == param.shape
                and (value.stride() != param.stride())
            ):
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
