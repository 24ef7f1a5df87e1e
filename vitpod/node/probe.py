"""On a node: its GPUs, NUMA, HCAs, pyxis, enroot and file systems as a JSON line (stdlib only)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

PREFIX = "vitpod-probe: "
NOT_FOUND = "not found"
GPU_QUERY = "index,name,memory.total,pci.bus_id"
SYSFS_ENV = "VITPOD_SYSFS"  # another sysfs root (tests give a node a fake one)


def tool(argv: list[str], timeout: float = 30) -> str:
    """The command's stdout, NOT_FOUND when the tool is missing, 'failed: ...' when it fails."""
    if shutil.which(argv[0]) is None:
        return NOT_FOUND
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    if out.returncode != 0:
        return f"failed: exit {out.returncode}: {(out.stderr or out.stdout).strip()[:300]}"
    return out.stdout


def infiniband_ports(sysfs: str | None = None) -> list[dict[str, str]]:
    """Every /sys/class/infiniband/<dev>/ports/<n>: state, rate and link layer."""
    root = Path(sysfs or os.environ.get(SYSFS_ENV, "/sys")) / "class" / "infiniband"
    ports = []
    for port in sorted(root.glob("*/ports/*")):
        ports.append(
            {
                "device": port.parent.parent.name,
                "port": port.name,
                "state": _read(port / "state"),
                "rate": _read(port / "rate"),
                "link_layer": _read(port / "link_layer"),
            }
        )
    return ports


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return NOT_FOUND


def pyxis_loaded() -> bool | str:
    """pyxis adds --container-image to srun's options (github.com/NVIDIA/pyxis README)."""
    help_text = tool(["srun", "--help"])
    return NOT_FOUND if help_text == NOT_FOUND else "--container-image" in help_text


def fs_types(paths: list[str]) -> dict[str, str]:
    """findmnt's file-system type of the mount holding each path (a path not made yet: its
    nearest existing parent's)."""
    out = {}
    for path in paths:
        where = Path(path)
        while not where.exists() and where != where.parent:
            where = where.parent
        found = tool(["findmnt", "-n", "-o", "FSTYPE", "-T", str(where)])
        out[path] = found.strip().splitlines()[0] if found.strip() else NOT_FOUND
    return out


def facts(paths: list[str]) -> dict[str, object]:
    return {
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "gpus": tool(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"]),
        "topo": tool(["nvidia-smi", "topo", "-m"]),
        "lscpu": tool(["lscpu"]),
        "numactl": tool(["numactl", "-H"]),
        "infiniband": infiniband_ports(),
        "pyxis": pyxis_loaded(),
        "enroot": tool(["enroot", "version"]).strip(),
        "fstype": fs_types(paths),
    }


def main(argv: list[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    print(PREFIX + json.dumps(facts(paths), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
