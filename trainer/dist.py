"""Rank discovery (Slurm or torchrun variables), process-group setup and a clean teardown."""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `vitpod-train --help` needs none
    import torch

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as 'gpu[07-09,12],login1' (zero padding kept)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r}: cannot parse a host name")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Ranks from torchrun variables (they win: torchrun may run inside sbatch) or Slurm's."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)), source="torchrun",
        )  # fmt: skip
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        # Derived from the job id (below the ephemeral ports, as workflows/planning/spec.py) per
        # job.
        port = int(env.get("MASTER_PORT", 10000 + job_id % 20000))
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]), local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=int(env["SLURM_NTASKS"]), master_addr=addr, master_port=port,
            source="slurm",
        )  # fmt: skip
    port = int(env.get("MASTER_PORT", DEFAULT_PORT))
    return DistEnv(0, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")


def device_for(env: DistEnv) -> torch.device:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init(env: DistEnv, timeout_s: int = 600) -> torch.device:
    """Join the process group (NCCL on GPU, gloo on CPU); returns this rank's device."""
    import torch
    import torch.distributed as dist

    device = device_for(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if env.source == "single" and "MASTER_PORT" not in os.environ:
        store: dist.Store = dist.HashStore()
    else:
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=env.is_main,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    return device


def teardown() -> None:
    """Barrier, then destroy the group; callers drop DDP/optimizer first (gloo may abort)."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def teardown_quietly() -> None:
    """After a startup error: leave the group without a barrier other ranks may never reach."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """True on every rank when `ok` is true on every rank (collective when distributed)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
