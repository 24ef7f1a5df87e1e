"""The engine registry: plan.json's engine name -> the builder that wraps the model in it."""

import json
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from vitpod.registry.engines import EngineName
from vitpod.trainer.engines.ddp_engine import DDPEngine
from vitpod.trainer.engines.deepspeed_engine import DeepSpeedEngine, deepspeed_config
from vitpod.trainer.engines.engine import Engine
from vitpod.trainer.model.optim import param_groups, timm_kwargs
from vitpod.trainer.speed.precision import Precision

log = logging.getLogger(__name__)


def _deepspeed(model: nn.Module, optimizer_factory, precision: Precision, cfg, loss_fn) -> Engine:
    if cfg.deepspeed_config:
        with open(cfg.deepspeed_config) as fh:
            ds_cfg = json.load(fh)
    else:
        dtype = cfg.amp_dtype if cfg.use_amp else None
        ds_cfg = deepspeed_config(
            cfg.batch_size, cfg.accum_steps, cfg.world_size, cfg.lr, cfg.weight_decay,
            cfg.zero_stage, dtype, cfg.clip_grad,
        )  # fmt: skip
        extra = timm_kwargs(cfg.opt_eps, cfg.opt_betas, cfg.momentum)
        ds_cfg["optimizer"]["params"].update(
            {k: list(v) if k == "betas" else v for k, v in extra.items() if k != "momentum"}
        )
    log.info("gradient engine: deepspeed ZeRO-%s", ds_cfg.get("zero_optimization", {}))
    return DeepSpeedEngine(model, param_groups(model, cfg.weight_decay), ds_cfg, cfg.token_label)


def _mesh(model: nn.Module, optimizer_factory, precision: Precision, cfg, loss_fn) -> Engine:
    # Imported here: DTensor and pipelining cost a rank about 1 s of imports it only pays
    # when its plan names a mesh.
    from vitpod.trainer.engines.mesh_engine import make_mesh_engine

    return make_mesh_engine(model, optimizer_factory, precision, cfg, loss_fn)


def _ddp(model: nn.Module, optimizer_factory, precision: Precision, cfg, loss_fn) -> Engine:
    servers = cfg.ps_servers or 1
    log.info(
        "gradient engine: DDP %s%s", cfg.engine, f" ({servers} servers)" * (cfg.engine == "ps")
    )
    optimizer = optimizer_factory(model)
    return DDPEngine(
        model, optimizer, precision, cfg.engine, servers, cfg.accum_steps, cfg.clip_grad,
        cfg.token_label, cfg.clip_mode,
    )  # fmt: skip


BUILDERS: dict[EngineName, Callable[..., Engine]] = {
    "ring": _ddp,
    "ps": _ddp,
    "deepspeed": _deepspeed,
    "fsdp": _mesh,
    "mesh": _mesh,
}
"""One builder per engine name of plan.json (registry/engines.py names them)."""


def parallelize(
    model: nn.Module, optimizer_factory, precision: Precision, cfg, loss_fn: Any = None
) -> Engine:
    """Wrap a model on its device in the engine its configuration names (cfg.engine)."""
    return BUILDERS[cfg.engine](model, optimizer_factory, precision, cfg, loss_fn)
