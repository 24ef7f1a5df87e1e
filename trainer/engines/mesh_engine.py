"""The DeviceMesh engine: FSDP2 (ZeRO-3), tensor and pipeline parallelism, composed as DP x PP x TP.

`parallelize_mesh` applies, in order: pipeline split (which blocks live here), tensor
parallelism (within the tp group), then FSDP2 over the dp group (Rajbhandari et al., "ZeRO",
arXiv:1910.02054; https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html), or,
without --fsdp, a DDP-style gradient all-reduce over the dp group.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from vitpod.trainer.checkpointing import dcp
from vitpod.trainer.engines.engine import token_label_forward
from vitpod.trainer.engines.mesh import Mesh, build_mesh
from vitpod.trainer.engines.pipeline_parallel import build_schedule, forward_only, split_vit
from vitpod.trainer.engines.tensor_parallel import (
    parallelize_vit_tp,
    parallelize_volo_tp,
    use_head_major_qkv,
)
from vitpod.trainer.model.qkv_layout import attention_heads, to_timm_layout
from vitpod.trainer.speed.precision import Precision

log = logging.getLogger(__name__)


def _is_vit(model: nn.Module) -> bool:
    return hasattr(model, "blocks") and hasattr(model, "patch_embed")


def _shard_units(model: Any) -> list[nn.Module]:
    """FSDP units: each transformer/outlooker block (ViT blocks, VOLO network and post blocks)."""
    if _is_vit(model):
        blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
        return list(blocks)
    units = [m for m in getattr(model, "network", []) if not isinstance(m, nn.Identity)]
    return units + list(getattr(model, "post_network", None) or [])


def parallelize_mesh(model: nn.Module, mesh: Mesh, cfg: Any) -> nn.Module:
    """Pipeline split, tensor parallelism, then FSDP2 or nothing (the engine all-reduces)."""
    heads = attention_heads(model)  # before the split: the export needs every block's heads
    use_head_major_qkv(model)
    if mesh.shape.pp > 1:
        model = split_vit(model, mesh.pp_rank, mesh.shape.pp)
    if mesh.shape.tp > 1:
        tp_mesh = mesh.sub("tp")
        (parallelize_vit_tp if _is_vit(model) else parallelize_volo_tp)(model, tp_mesh)
    if cfg.fsdp:
        dp_mesh = mesh.sub("dp")
        # With micro-batches a stage runs forward several times per step: re-gathering the
        # weights for each would multiply the all-gathers, so pipelines keep them (ZeRO-2-like).
        reshard = cfg.reshard_after_forward and mesh.shape.pp == 1
        for unit in _shard_units(model):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    model.timm_heads = heads  # type: ignore[assignment]
    return model


class MeshEngine:
    """Forward/backward/step over the mesh; the loop sees the same calls as with DDP."""

    def __init__(self, model: nn.Module, optimizer_factory, precision: Precision, cfg: Any,
                 mesh: Mesh, loss_fn: Any) -> None:  # fmt: skip
        self.cfg, self.mesh, self.precision = cfg, mesh, precision
        self.name = cfg.engine  # fsdp, or mesh (tensor or pipeline stages)
        self.model = parallelize_mesh(model, mesh, cfg)
        del optimizer_factory  # its fused AdamW does not take DTensors mixed with tensors
        self.optimizer = _optimizer(self.model, cfg)
        self.accum_steps = cfg.accum_steps
        self.pipelined = mesh.shape.pp > 1
        self.saver = dcp.AsyncSaver()
        self._comm = 0.0
        self._buffer: list[tuple[torch.Tensor, Any]] = []
        self.batch_losses = torch.zeros(0)
        # the async save's last file
        self.sharded_files: tuple[str, ...] = (f"{dcp.SUBDIR}/{dcp.METADATA}",)
        # Buffers are replicated, not sharded, but each rank's forward moves its own BatchNorm
        # statistics: like DDP (broadcast_buffers), every rank keeps the first rank's.
        self._buffers = [b for b in self.model.buffers() if not isinstance(b, DTensor)]
        has_buffers = mesh.shape.dp > 1 and bool(self._buffers)
        self._buffer_src = mesh.global_rank("dp", 0) if has_buffers else None
        if self.pipelined:
            # The micro-batches are the accumulation steps; with fewer steps than stages the
            # step's batch is cut into pp micro-batches instead, so every stage has work.
            self.micro_batches = max(cfg.accum_steps, mesh.shape.pp)
            self.schedule = build_schedule(
                self.model, mesh.pp_rank, mesh.shape.pp, precision.device, mesh.group("pp"),
                self.micro_batches, loss_fn, cfg.pp_schedule,
            )  # fmt: skip

    # ------------------------------------------------------------------ one micro-batch
    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        if isinstance(self.model, FSDPModule) and not self.pipelined:
            # FSDP2 reduce-scatters only on the last micro-batch of an accumulation.
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def forward(self, images: torch.Tensor) -> Any:
        if not self.model.training:
            return self.model(images)
        if self.cfg.token_label:
            output = token_label_forward(self.model, images)
        else:
            output = self.model(images)
        self._sync_buffers()
        return output

    def _sync_buffers(self) -> None:
        """The dp group's first rank's buffers on every rank once the forward moved them. A
        sharded checkpoint keeps one copy of a replicated tensor, from any rank: with the
        copies equal it is the one an uninterrupted run goes on with."""
        if self._buffer_src is None:
            return
        for buffer in self._buffers:
            dist.broadcast(buffer, src=self._buffer_src, group=self.mesh.group("dp"))

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum_steps).backward()

    def pipeline_micro(self, images: torch.Tensor, targets: Any, last: bool) -> torch.Tensor:
        """Collect the accumulation's micro-batches; on the last one run the schedule over them.

        Returns, on every rank, the loss of the last loader batch (what the loop reports for the
        other engines, so the curves compare); the last stage computed it. `batch_losses` then
        holds the loss of each of the step's loader batches, in order."""
        self._buffer.append((images, targets))
        if not last:
            return torch.zeros((), device=images.device)
        batch = torch.cat([b for b, _ in self._buffer])
        target = torch.cat([t for _, t in self._buffer])
        self._buffer.clear()
        losses: list[torch.Tensor] = []
        first, final = self.mesh.pp_rank == 0, self.mesh.pp_rank == self.mesh.shape.pp - 1
        args = (batch,) if first else ()
        self.schedule.step(*args, target=target if final else None, losses=losses)
        # A loader batch may have been cut into several micro-batches: average those.
        per_batch = self.micro_batches // self.accum_steps
        self.batch_losses = (
            torch.stack(losses).detach().float().view(self.accum_steps, per_batch).mean(1)
            if final
            else torch.zeros(self.accum_steps, device=batch.device)
        )
        src = self.mesh.global_rank("pp", self.mesh.shape.pp - 1)
        dist.broadcast(self.batch_losses, src=src, group=self.mesh.group("pp"))
        return self.batch_losses[-1]

    def discard_partial(self) -> None:
        """Forget the micro-batches of an accumulation the epoch's end cut short."""
        self._buffer.clear()

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        start = time.perf_counter()
        if not self.cfg.fsdp and self.mesh.shape.dp > 1:
            self._all_reduce_grads()
        self._comm += time.perf_counter() - start
        if self.cfg.clip_grad:
            self._clip(self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _all_reduce_grads(self) -> None:
        """DDP's arithmetic (each gradient x 1/dp, then summed) over the dp group, coalesced."""
        group, scale = self.mesh.group("dp"), 1.0 / self.mesh.shape.dp
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(scale)
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _clip(self, max_norm: float) -> None:
        """Global grad-norm clipping: DTensor norms are global; stages add up over the pp group."""
        squares = torch.zeros((), dtype=torch.float64, device=self.precision.device)
        for p in self.model.parameters():
            if p.grad is not None:
                norm = p.grad.norm()
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                squares += norm.double() ** 2
        if self.mesh.shape.pp > 1:
            dist.all_reduce(squares, group=self.mesh.group("pp"))
        coef = min(1.0, max_norm / (float(squares.sqrt()) + 1e-6))
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)

    def comm_seconds(self) -> float:
        value, self._comm = self._comm, 0.0
        return value

    # ------------------------------------------------------------------ evaluation
    def eval_forward(self, images: torch.Tensor) -> torch.Tensor | None:
        """Logits, or None on ranks that do not produce them (earlier pipeline stages)."""
        if not self.pipelined:
            return self.model(images)
        return forward_only(self.model, images, self.mesh.group("pp"), self.mesh.pp_rank,
                            self.mesh.shape.pp)  # fmt: skip

    @property
    def counts_eval(self) -> bool:
        """One rank per model replica adds its samples to the evaluation totals."""
        return self.mesh.tp_rank == 0 and self.mesh.pp_rank == self.mesh.shape.pp - 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {}  # model and optimizer go to the sharded checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def save_sharded(self, directory: Path) -> None:
        self.saver.save(self.model, self.optimizer, directory)

    def wait_sharded(self) -> None:
        self.saver.wait()

    def load_sharded(self, directory: Path) -> None:
        dcp.load(self.model, self.optimizer, directory)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model in timm's layout on global rank 0 (None elsewhere); collective."""
        state = dcp.full_model_state(self.model)
        stages: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        mine = state if self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0 else None
        dist.gather_object(mine, stages if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in stages:
            full.update(part or {})
        heads: dict[str, int] = self.model.timm_heads  # type: ignore[assignment]
        return to_timm_layout(full, heads)


def _optimizer(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The configured optimizer, one tensor at a time (foreach=False).

    Multi-tensor kernels refuse plain tensors mixed with DTensors (or DTensors of two meshes);
    splitting the groups by layout would make the number of groups depend on the mesh, and
    a checkpoint's optimizer state would then not load into another mesh. The same two weight
    decay groups in every layout keep sharded checkpoints portable.
    """
    from timm.optim import create_optimizer_v2

    from vitpod.trainer.model.optim import param_groups, takes_foreach, timm_kwargs

    groups = param_groups(model, cfg.weight_decay)
    log.info("optimizer %s: single-tensor implementation (sharded parameters)", cfg.opt)
    return create_optimizer_v2(groups, opt=cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               foreach=False if takes_foreach(cfg.opt) else None,
                               **timm_kwargs(cfg.opt_eps, cfg.opt_betas,
                                                            cfg.momentum))  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def make_mesh_engine(model: nn.Module, optimizer_factory, precision: Precision, cfg: Any,
                     loss_fn: Any) -> MeshEngine:  # fmt: skip
    mesh = build_mesh(precision.device, cfg.tp, cfg.pp)
    log.info(
        "mesh engine: dp %d x pp %d x tp %d%s", mesh.shape.dp, mesh.shape.pp, mesh.shape.tp,
        " with FSDP2" if cfg.fsdp else "",
    )  # fmt: skip
    return MeshEngine(model, optimizer_factory, precision, cfg, mesh, loss_fn)
