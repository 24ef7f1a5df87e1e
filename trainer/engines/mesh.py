"""One DeviceMesh (dp, pp, tp) for FSDP2, tensor and pipeline parallelism, and what it holds."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from vitpod.registry.paralleldims import ParallelDims

if TYPE_CHECKING:  # imported when a mesh is built: DTensor's import costs ~0.7 s of startup
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Mesh:
    """The mesh and this rank's coordinates (tp innermost: a tp group is consecutive ranks,
    so with ranks placed node by node it stays inside one node's NVLink domain)."""

    shape: ParallelDims
    device_mesh: DeviceMesh
    dp_rank: int
    pp_rank: int
    tp_rank: int

    def group(self, name: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(name)

    def sub(self, name: str) -> DeviceMesh:
        return self.device_mesh[name]

    def global_rank(self, name: str, index: int) -> int:
        """Global rank of `index` along dimension `name`, with this rank's other coordinates."""
        return dist.get_global_rank(self.group(name), index)


def build_mesh(device: torch.device, tp: int, pp: int) -> Mesh:
    """DeviceMesh of the whole job, shape (dp, pp, tp) with dp = world / (tp x pp)."""
    shape = ParallelDims.of_world(dist.get_world_size(), tp, pp)
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(
        device.type, (shape.dp, shape.pp, shape.tp), mesh_dim_names=("dp", "pp", "tp")
    )
    coords = device_mesh.get_coordinate() or [0, 0, 0]
    return Mesh(shape, device_mesh, dp_rank=coords[0], pp_rank=coords[1], tp_rank=coords[2])


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank stores (a DTensor counts only its local shard)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists without it
    total = 0
    for p in model.parameters():
        local = p.to_local() if tensor_module and isinstance(p, tensor_module.DTensor) else p
        total += local.numel() * local.element_size()
    return total


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest value on any rank (pipeline stages differ; the largest one sets memory)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def job_images_per_s(images: float, seconds: float, device: torch.device) -> float:
    """The job's throughput: every rank's images over the slowest rank's seconds."""
    # On the collective's device: NCCL has no CPU tensors (found on an H100, not on gloo).
    rate = torch.tensor([images, seconds], dtype=torch.float64, device=device)
    total = rate.clone()
    dist.all_reduce(total)
    dist.all_reduce(rate, op=dist.ReduceOp.MAX)
    return float(total[0]) / max(float(rate[1]), 1e-9)
