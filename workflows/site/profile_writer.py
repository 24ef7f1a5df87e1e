"""Slurm facts + probe facts -> a discovered profile's node types and partitions."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vitpod.node.probe import NOT_FOUND
from vitpod.workflows.site import binding
from vitpod.workflows.slurm.partitions import NodeInfo, PartitionInfo

DEFAULT_TIME = "24:00:00"  # when the partition has no MaxTime
# Placeholders until `make calibrate` measures the fabric: low on purpose, so a topology
# choice made before calibration errs towards the cheaper-to-communicate layouts.
PLACEHOLDER_FABRIC = {"intra_bw": "10 GB/s", "intra_latency": "10 us", "inter_latency": "20 us"}
_RATE = re.compile(r"^(\d+(?:\.\d+)?) Gb/sec")


@dataclass
class Discovered:
    """What discovery decided, and one line for each thing it could not determine."""

    partitions: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_types: dict[str, dict[str, Any]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each node type's probe facts (for --check and the profile's comments)."""
    max_minutes: dict[str, int | None] = field(default_factory=dict)
    """Each stage partition's MaxTime in minutes (None: unlimited)."""
    shared_paths: list[str] | None = None
    """The run root and code dir where every node saw a file written on one of them (None: one
    node, nothing to test); storage.shared_paths records them."""
    shared_note: str = ""


def type_name(nodes: list[NodeInfo], taken: set[str]) -> str:
    """'a100' from the Gres type, else 'cpu<N>'; a suffix when the name is taken."""
    first = nodes[0]
    base = re.sub(r"[^A-Za-z0-9_.-]", "", first.gpu_type.lower()) or f"cpu{first.cpus}"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


def time_limit(part: PartitionInfo, unknown: list[str]) -> str:
    if part.max_minutes is None:
        unknown.append(
            f"partitions: {part.name} has no MaxTime; wrote time {DEFAULT_TIME} (set your own)"
        )
        return DEFAULT_TIME
    return part.max_time


def node_type(
    nodes: list[NodeInfo], facts: dict[str, Any], storage_hcas: set[str],
    tasks_per_node: int | None, unknown: list[str],
) -> dict[str, Any]:  # fmt: skip
    """One node type's fields from Slurm's record and the probe's facts."""
    slurm_node = nodes[0]
    where = f"node type of {slurm_node.name}"
    gpus = gpu_list(facts.get("gpus", NOT_FOUND))
    cpu = _lscpu(facts, unknown, where)
    cpus = min(slurm_node.cpus, cpu.cpus) if cpu else slurm_node.cpus
    if cpu and cpu.cpus != slurm_node.cpus:
        unknown.append(
            f"{where}: Slurm says CPUTot={slurm_node.cpus}, lscpu {cpu.cpus}; wrote "
            f"cpus_per_node {cpus}"
        )
    if not gpus and slurm_node.gpus:
        unknown.append(
            f"{where}: Slurm's Gres says {slurm_node.gres} but nvidia-smi reports none "
            f"({_short(facts.get('gpus'))}); wrote gpus_per_node 0 (CPU ranks, backend gloo)"
        )
    hcas = compute_hcas(facts.get("infiniband", []), storage_hcas, unknown, where)
    out: dict[str, Any] = {"gpus_per_node": len(gpus), "cpus_per_node": cpus, "mem": "0"}
    if gpus:
        out["gpu"] = {"model": gpus[0][0], "memory_bytes": gpus[0][1]}
        out["binding"] = _gpu_binding(facts, cpu, hcas, unknown, where)
    else:
        out["tasks_per_node"] = tasks_per_node or 1
        out["binding"] = cpu_binding(cpu, out["tasks_per_node"]) if cpu else []
    ranks = len(gpus) or out["tasks_per_node"]
    out["fabric"] = placeholder_fabric(ranks, hcas, facts.get("infiniband", []))
    return out


def _lscpu(facts: dict[str, Any], unknown: list[str], where: str) -> binding.CpuTopology | None:
    try:
        cpu = binding.parse_lscpu(str(facts.get("lscpu", "")))
    except ValueError:
        unknown.append(f"{where}: lscpu {_short(facts.get('lscpu'))}; no NUMA binding")
        return None
    if not cpu.numa_cpus:
        numa = binding.parse_numactl(str(facts.get("numactl", "")))
        cpu = binding.CpuTopology(cpu.cpus, cpu.sockets, cpu.threads_per_core, numa, cpu.model)
    return cpu


def _gpu_binding(
    facts: dict[str, Any], cpu: binding.CpuTopology | None, hcas: dict[str, int],
    unknown: list[str], where: str,
) -> list[dict[str, Any]]:  # fmt: skip
    try:
        gpu_topo = binding.parse_topo(str(facts.get("topo", "")))
    except ValueError:
        unknown.append(f"{where}: nvidia-smi topo -m {_short(facts.get('topo'))}; no binding")
        return []
    if not hcas:
        unknown.append(f"{where}: no compute HCA with an active port; binding has no hca")
    return binding.derive_binding(gpu_topo, cpu, hcas)


def gpu_list(text: Any) -> list[tuple[str, int]]:
    """nvidia-smi --query-gpu=index,name,memory.total,... (MiB) -> [(model, bytes)]."""
    out = []
    for line in str(text).splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit() and parts[2].isdigit():
            model = parts[1].removeprefix("NVIDIA ").replace(" ", "-")
            out.append((model, int(parts[2]) * 1024 * 1024))
    return out


def compute_hcas(
    ports: list[dict[str, str]], storage: set[str], unknown: list[str], where: str
) -> dict[str, int]:
    """HCA -> its first active port on the compute fabric: InfiniBand when any port is, else
    Ethernet (a RoCE cluster). Storage HCAs (--storage-hca) and the others are left out."""
    active = [p for p in ports if p["state"].endswith("ACTIVE") and p["port"].isdigit()
              and p["device"] not in storage]  # fmt: skip
    layers = {p.get("link_layer") for p in active}
    fabric = "InfiniBand" if "InfiniBand" in layers or not layers else "Ethernet"
    out: dict[str, int] = {}
    for p in active:
        if p.get("link_layer", fabric) == fabric:
            out.setdefault(p["device"], int(p["port"]))
    left = sorted({p["device"] for p in ports} - set(out) - storage)
    if left:
        unknown.append(f"{where}: HCAs {left} have no active {fabric} port; left out")
    return out


def cpu_binding(cpu: binding.CpuTopology, tasks: int) -> list[dict[str, Any]]:
    """CPU-only ranks: rank i on NUMA node i mod nodes, with that node's CPUs."""
    nodes = sorted(cpu.numa_cpus)
    if not nodes:
        return []
    numa = [nodes[i % len(nodes)] for i in range(tasks)]
    return [{"local_rank": i, "numa": n, "cpus": cpu.numa_cpus[n]} for i, n in enumerate(numa)]


def placeholder_fabric(ranks: int, hcas: dict[str, int], ports: list[dict[str, str]]) -> dict:
    """Conservative numbers, labelled in the profile, until `make calibrate` measures them."""
    rates = [_RATE.match(p["rate"]) for p in ports if p["device"] in hcas]
    gbit = min((float(m.group(1)) for m in rates if m), default=10.0)
    layers = {p.get("link_layer") for p in ports if p["port"] == str(hcas.get(p["device"]))}
    network = "ethernet" if not hcas else "infiniband" if "Ethernet" not in layers else "roce"
    return {"network": network, "gpus_per_node": ranks, **PLACEHOLDER_FABRIC,
            "nic_bw": f"{gbit:g} Gb/s", "nics_per_node": max(1, len(hcas))}  # fmt: skip


def _short(value: Any) -> str:
    text = str(value or NOT_FOUND).strip().splitlines()
    return (text[0] if text else NOT_FOUND)[:120]


def partition_entry(part: PartitionInfo, type_key: str, unknown: list[str]) -> dict[str, Any]:
    usable = sum(n.usable for n in part.nodes)
    entry: dict[str, Any] = {"name": part.name, "time": time_limit(part, unknown),
                             "node_type": type_key, "nodes": max(1, usable)}  # fmt: skip
    limit = len(part.nodes) if part.max_nodes is None else part.max_nodes
    entry["max_nodes"] = max(entry["nodes"], min(limit, len(part.nodes)))
    if usable < len(part.nodes):
        bad = [f"{n.name} ({n.state})" for n in part.nodes if not n.usable]
        unknown.append(f"partitions: {part.name}: not usable now: {', '.join(bad)}")
    return entry
