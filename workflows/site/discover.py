"""A site as Slurm reports it (one sinfo, one scontrol per kind); one probe job per node type."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

from vitpod.node.probe import PREFIX
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.doctor_step import NODE_SCRIPTS
from vitpod.workflows.slurm.partitions import NodeInfo, PartitionInfo
from vitpod.workflows.slurm.partitions import gres_gpu as gres_gpu

PROBE_TIME = "00:05:00"


def node_info(fields: dict[str, str]) -> NodeInfo:
    """A node from `scontrol show node`'s fields for it."""
    return NodeInfo(
        name=fields["NodeName"],
        cpus=int(fields.get("CPUTot", "0")),
        sockets=int(fields.get("Sockets", "1")),
        memory_mb=int(fields.get("RealMemory", "0")),
        gres=fields.get("Gres", "(null)"),
        features=fields.get("AvailableFeatures", "(null)"),
        state=fields.get("State", "UNKNOWN"),
        reason=fields.get("Reason", ""),
        partitions=tuple(p for p in fields.get("Partitions", "").split(",") if p),
    )


def all_nodes() -> list[NodeInfo]:
    return [node_info(r) for r in slurm.scontrol_show("node")]


def site() -> dict[str, PartitionInfo]:
    """Every partition with its nodes: one sinfo (default partition), one scontrol each kind."""
    default = {
        p.rstrip("*") for row in slurm.sinfo({"p": "%P"}) if (p := row["p"].strip()).endswith("*")
    }
    nodes = all_nodes()
    parts = {}
    for rec in slurm.scontrol_show("partition"):
        name = rec["PartitionName"]
        mine = tuple(n for n in nodes if name in n.partitions)
        parts[name] = PartitionInfo.from_scontrol(rec, mine, default=name in default)
    return parts


def node_types(part: PartitionInfo) -> list[list[NodeInfo]]:
    """A partition's nodes grouped by their hardware facts."""
    groups: dict[tuple[object, ...], list[NodeInfo]] = {}
    for node in part.nodes:
        groups.setdefault(node.kind, []).append(node)
    return list(groups.values())


def probe_command(python: str, scripts: Path, paths: list[str]) -> list[str]:
    return [python, str(scripts / "probe.py"), *paths]


def run_probe(
    partition: str, node: NodeInfo, paths: list[str], python: str = sys.executable,
    scripts: Path = NODE_SCRIPTS,
) -> dict[str, Any]:  # fmt: skip
    """One short job on `node`: the probe's facts, or ConfigError with what srun said. It asks
    for the node's GPUs: where Slurm constrains devices, a job sees only the GPUs it asked for."""
    gres = [f"--gres=gpu:{node.gpus}"] if node.gpus else []
    argv = ["srun", "-N1", "-n1", "-p", partition, "-w", node.name, f"--time={PROBE_TIME}",
            "--job-name=vitpod-probe", *gres, *probe_command(python, scripts, paths)]  # fmt: skip
    out = slurm.run(argv)
    for line in out.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX) :])  # type: ignore[no-any-return]
    raise ConfigError(f"probe on {node.name} printed no facts: {out[-500:]}")


_WRITE = 'mkdir -p -- "$1" && printf %s "$2" > "$1/$3"'
_READ = 'printf "%s %s\\n" "$SLURMD_NODENAME" "$(cat -- "$1/$2" 2>/dev/null)"'


def unseen(partition: str, nodes: list[str], path: str) -> list[str]:
    """The nodes that do not see a file written into `path` on the first of `nodes` (made if
    missing): [] when every node sees the same file system there. One srun writes the marker,
    one reads it on the others (a task each), one removes it."""
    token = secrets.token_hex(8)
    name = f".vitpod-shared-{token}"
    base = ["srun", "-p", partition, f"--time={PROBE_TIME}", "--job-name=vitpod-probe"]
    first, rest = nodes[0], nodes[1:]
    slurm.run([*base, "-N1", "-n1", "-w", first, "sh", "-c", _WRITE, "sh", path, token, name])
    try:
        said = slurm.run([*base, f"-N{len(rest)}", f"-n{len(rest)}", "--ntasks-per-node=1",
                          "-w", ",".join(rest), "sh", "-c", _READ, "sh", path, name])  # fmt: skip
    finally:
        slurm.run([*base, "-N1", "-n1", "-w", first, "rm", "-f", "--", f"{path}/{name}"])
    seen = {n for n, _, got in (ln.partition(" ") for ln in said.splitlines()) if got == token}
    return [n for n in rest if n not in seen]
