"""Pipeline stages of a timm ViT and their schedule (torch.distributed.pipelining).

The blocks are split into contiguous stages and the batch into micro-batches (the
accumulation steps), run by GPipe (Huang et al., arXiv:1811.06965) or 1F1B (Narayanan et al.,
PipeDream, arXiv:1806.03377) as implemented by torch
(https://pytorch.org/docs/stable/distributed.pipelining.html). A stage is the original model
with the other stages' modules removed, so parameter names (FQNs) are those of the full model
and sharded checkpoints load across pipeline layouts.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from vitpod.registry.models import stage_bounds

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def split_vit(model: Any, stage: int, stages: int) -> nn.Module:
    """Keep only stage `stage` of a timm VisionTransformer, in place; returns the model."""
    start, end = stage_bounds(len(model.blocks), stages)[stage]
    # A ModuleDict keyed by the original indices keeps names such as blocks.7.attn.qkv.weight.
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, end)})
    model.pp_first, model.pp_last = stage == 0, stage == stages - 1
    if not model.pp_first:
        model.patch_embed = nn.Identity()
        for name in ("cls_token", "reg_token", "pos_embed"):
            if getattr(model, name, None) is not None:
                model.register_parameter(name, None)
    if not model.pp_last:
        for name in ("norm", "fc_norm", "head", "attn_pool"):
            if isinstance(getattr(model, name, None), nn.Module):
                setattr(model, name, nn.Identity())
    model.forward = types.MethodType(_stage_forward, model)  # type: ignore[method-assign]
    return model


def _stage_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Images -> tokens on the first stage, tokens -> tokens, tokens -> logits on the last."""
    if self.pp_first:
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
    for block in self.blocks.values():
        x = block(x)
    if self.pp_last:
        x = self.forward_head(self.norm(x))
    return x


def build_schedule(
    model: nn.Module, stage: int, stages: int, device: torch.device, group: dist.ProcessGroup,
    micro_batches: int, loss_fn: Any, name: str,
) -> Any:  # fmt: skip
    """The torch schedule that runs this rank's stage (grads are averaged over micro-batches)."""
    pipe_stage = PipelineStage(model, stage, stages, device, group=group)
    return SCHEDULES[name](pipe_stage, n_microbatches=micro_batches, loss_fn=loss_fn)


def forward_only(
    model: nn.Module, images: torch.Tensor, group: dist.ProcessGroup, stage: int, stages: int
) -> torch.Tensor | None:
    """Evaluation through the stages with plain send/recv (any batch size); logits on the last
    stage, None elsewhere."""
    device = images.device
    if stage == 0:
        x = images
    else:
        shape = torch.empty(3, dtype=torch.long, device=device)
        dist.recv(shape, group=group, group_src=stage - 1)
        x = torch.empty(*shape.tolist(), dtype=torch.float32, device=device)
        dist.recv(x, group=group, group_src=stage - 1)
    out = model(x)
    if stage == stages - 1:
        return out
    out = out.float().contiguous()  # under autocast a stage may output bf16
    dist.send(torch.tensor(out.shape, dtype=torch.long, device=device), group=group,
              group_dst=stage + 1)  # fmt: skip
    dist.send(out, group=group, group_dst=stage + 1)
    return None
