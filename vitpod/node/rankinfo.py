"""Print one rank's facts (Slurm ids, rendezvous, binding, CPU affinity, container) as JSON."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

PREFIX = "rankinfo: "
_VARS = (
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURMD_NODENAME",
    "SLURM_RESTART_COUNT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "VITPOD_BIND_NUMA",
    "VITPOD_BIND_CPUS",
    "VITPOD_BIND_HCA",
    "NCCL_IB_HCA",
    "UCX_NET_DEVICES",
    "OMP_NUM_THREADS",
)


def facts() -> dict[str, object]:
    info: dict[str, object] = {name: os.environ.get(name) for name in _VARS}
    info["hostname"] = socket.gethostname()
    info["affinity"] = sorted(os.sched_getaffinity(0))
    info["container_root"] = container_root()
    return info


def container_root() -> str | None:
    """The host directory mounted as this process's `/` (an enroot container's, e.g. pyxis_NAME
    for a named pyxis container), or None outside a container (proc(5): mountinfo fields 4-5)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for fields in (line.split() for line in lines):
        if len(fields) > 4 and fields[4] == "/" and fields[3] != "/":
            return fields[3]
    return None


def main() -> int:
    print(PREFIX + json.dumps(facts(), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
