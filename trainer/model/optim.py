"""timm's optimizers (AdamW/LAMB in their fastest implementation) with weight-decay or layer-decay
groups, and timm's LR schedules stepped per optimizer update."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from timm.optim import (
    create_optimizer_v2,
    param_groups_layer_decay,
    param_groups_weight_decay,
)
from timm.scheduler import create_scheduler_v2
from torch import nn

from vitpod.trainer.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)


def param_groups(
    model: nn.Module, weight_decay: float, layer_decay: float | None = None
) -> list[dict[str, Any]]:
    """No decay on norms, biases (1-d) and the model's no_weight_decay() names (pos embeddings);
    with layer_decay, timm's per-layer groups (each an lr_scale the schedule applies)."""
    names = getattr(model, "no_weight_decay", None)
    skip = set(names()) if callable(names) else set()
    if layer_decay is None:
        return param_groups_weight_decay(model, weight_decay, no_weight_decay_list=skip)
    if not callable(getattr(model, "group_matcher", None)):
        raise ConfigError(
            f"--layer-decay {layer_decay}: {type(model).__name__} has no group_matcher (timm's "
            "layer grouping); drop --layer-decay or use a timm ViT/VOLO"
        )
    return param_groups_layer_decay(
        model, weight_decay, no_weight_decay_list=skip, layer_decay=layer_decay
    )


def takes_foreach(opt: str) -> bool:
    """Whether timm's class for `opt` has a foreach switch (timm passes one to any class)."""
    import inspect

    from timm.optim import get_optimizer_class

    cls = get_optimizer_class(opt.lower().removeprefix("lookahead_"), bind_defaults=False)
    return "foreach" in inspect.signature(cls).parameters


def timm_kwargs(
    eps: float | None, betas: tuple[float, ...] | None, momentum: float
) -> dict[str, Any]:
    """--opt-eps, --opt-betas, --momentum as timm's train.py passes them (unset: the default)."""
    out: dict[str, Any] = {"momentum": momentum}
    if eps is not None:
        out["eps"] = eps
    if betas is not None:
        out["betas"] = tuple(betas)
    return out


def _apex_available() -> bool:
    try:
        importlib.import_module("apex.optimizers")
    except ImportError:
        return False
    return True


def choose_implementation(opt: str, device: torch.device) -> str:
    """adamw/lamb: apex FusedAdam/FusedLAMB (when apex imports, GPU) -> torch fused (adamw) ->
    foreach (lamb); any other timm name: timm's own implementation."""
    if opt not in ("adamw", "lamb"):
        return "timm"
    if device.type == "cuda" and _apex_available():
        return f"apex fused{opt.removesuffix('w')}"
    if opt == "adamw":
        return "torch fused"
    return "foreach"


def create_optimizer(
    model: nn.Module, opt: str, lr: float, weight_decay: float, device: torch.device,
    eps: float | None = None, betas: tuple[float, ...] | None = None, momentum: float = 0.9,
    layer_decay: float | None = None, opt_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.optim.Optimizer, str]:  # fmt: skip
    """The optimizer (timm's create_optimizer_v2 for every name but the AdamW fast path) and the
    name of the implementation chosen (logged once)."""
    if opt.lower().startswith(("bnb", "fused")) and device.type != "cuda":
        raise ConfigError(f"--opt {opt}: bitsandbytes/apex optimizers run on CUDA GPUs only; "
                          "use its timm counterpart (e.g. adamw, lamb, sgd) here")  # fmt: skip
    impl = choose_implementation(opt, device)
    groups = param_groups(model, weight_decay, layer_decay)
    kwargs = {**timm_kwargs(eps, betas, momentum), **(opt_kwargs or {})}  # timm's --opt-kwargs
    optimizer: torch.optim.Optimizer
    try:
        if impl == "torch fused":
            del kwargs["momentum"]
            optimizer = torch.optim.AdamW(
                groups, lr=lr, weight_decay=weight_decay, fused=True, **kwargs
            )
        else:
            name = impl.split()[1] if impl.startswith("apex") else opt
            optimizer = create_optimizer_v2(
                groups, opt=name, lr=lr, weight_decay=weight_decay,
                foreach=True if impl == "foreach" else None, **kwargs,
            )  # fmt: skip
    except ImportError as err:  # timm's bnb*/fused* need bitsandbytes/apex
        raise ConfigError(f"--opt {opt}: {err}; install it or pick another --opt") from err
    except TypeError as err:  # an --opt-kwargs key the optimizer does not take
        raise ConfigError(
            f"--opt-kwargs {opt_kwargs}: {err}; give arguments of --opt {opt}"
        ) from None
    log.info("optimizer %s: %s implementation", opt, impl)
    return optimizer, impl


def create_schedule(
    optimizer: torch.optim.Optimizer,
    epochs: int,
    warmup_epochs: int,
    warmup_lr: float,
    min_lr: float,
    steps_per_epoch: int,
    sched: str = "cosine",
    decay_epochs: float | None = None,
    decay_milestones: tuple[int, ...] = (90, 180, 270),
    decay_rate: float = 0.1,
    on_updates: bool = True,
    cooldown_epochs: int = 0,
):
    """timm's warmup + `sched` (+ --cooldown-epochs at min_lr), moved by `step_update(global
    step)`: its position is the step count, so a resumed run's LR is the uninterrupted run's.
    on_updates=False is timm's per-epoch stepping (its train.py default): the LR changes at
    epoch starts only (EpochStepped)."""
    decay: dict[str, Any] = {} if decay_epochs is None else {"decay_epochs": decay_epochs}
    updates = max(1, steps_per_epoch)
    try:
        scheduler, _ = create_scheduler_v2(
            optimizer, sched=sched, num_epochs=epochs, warmup_epochs=warmup_epochs,
            warmup_lr=warmup_lr, min_lr=min_lr, decay_milestones=list(decay_milestones),
            decay_rate=decay_rate, step_on_epochs=not on_updates, updates_per_epoch=updates,
            cooldown_epochs=cooldown_epochs,
            # unset: timm's own default (timm < 1.0.31 multiplies a None here and fails)
            **decay,
        )  # fmt: skip
    except ValueError as err:  # wsd/rsqrt: a decay length that does not fit the run
        raise ConfigError(f"--sched {sched}: {err}") from err
    return scheduler if on_updates else EpochStepped(scheduler, updates)


class EpochStepped:
    """A timm schedule built per epoch (step_on_epochs), driven by the update count as every
    vitpod schedule is: update n is in epoch n // updates_per_epoch, whose LR timm's
    `scheduler.step(epoch)` sets; a function of n, so resuming needs no state of its own."""

    def __init__(self, scheduler: Any, updates_per_epoch: int) -> None:
        self.scheduler, self.updates_per_epoch = scheduler, updates_per_epoch

    def step_update(self, num_updates: int) -> None:
        self.scheduler.step(num_updates // self.updates_per_epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


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


def optimizer_for(model: nn.Module, cfg: TrainConfig, device: torch.device) -> Any:
    """create_optimizer with the run's --opt, --lr, --weight-decay, --opt-eps, --opt-betas,
    --momentum and --layer-decay."""
    optimizer, _ = create_optimizer(
        model, cfg.opt, cfg.lr or 0.0, cfg.weight_decay, device, cfg.opt_eps, cfg.opt_betas,
        cfg.momentum, cfg.layer_decay, cfg.opt_kwargs,
    )  # fmt: skip
    return optimizer


def schedule_for(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int):
    """create_schedule with the run's --sched, warmup, floor and decay flags."""
    return create_schedule(
        optimizer, cfg.epochs, cfg.warmup_epochs, cfg.warmup_lr, cfg.min_lr, steps_per_epoch,
        cfg.sched, cfg.decay_epochs, cfg.decay_milestones, cfg.decay_rate, cfg.sched_on_updates,
        cfg.cooldown_epochs,
    )  # fmt: skip
