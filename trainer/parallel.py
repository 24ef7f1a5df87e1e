"""Pick the gradient engine the config names (ring | ps | deepspeed | mesh) and wrap the model."""

import json
import logging
from typing import Any

from torch import nn

from vitpod.trainer.ddp_engine import DDPEngine
from vitpod.trainer.deepspeed_engine import DeepSpeedEngine, deepspeed_config
from vitpod.trainer.engine import Engine
from vitpod.trainer.mesh_engine import make_mesh_engine
from vitpod.trainer.optim import param_groups, timm_kwargs
from vitpod.trainer.precision import Precision

log = logging.getLogger(__name__)


def parallelize(
    model: nn.Module, optimizer_factory, precision: Precision, cfg, loss_fn: Any = None
) -> Engine:
    """Apply the engine chosen by cfg (ring | ps | deepspeed | mesh) to a model on its device."""
    if cfg.uses_mesh:
        return make_mesh_engine(model, optimizer_factory, precision, cfg, loss_fn)
    if cfg.deepspeed:
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
        return DeepSpeedEngine(
            model, param_groups(model, cfg.weight_decay), ds_cfg, cfg.token_label
        )
    # Without a plan.json (a direct run), --topology auto means the default all-reduce.
    topology = "ring" if cfg.topology == "auto" else cfg.topology
    servers = cfg.ps_servers or 1
    log.info("gradient engine: DDP %s%s", topology, f" ({servers} servers)" * (topology == "ps"))
    optimizer = optimizer_factory(model)
    return DDPEngine(
        model, optimizer, precision, topology, servers, cfg.accum_steps, cfg.clip_grad,
        cfg.token_label,
    )  # fmt: skip
