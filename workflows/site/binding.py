"""The hardware binding: node topology from tool output (nvidia-smi topo -m, lscpu, numactl -H)
-> the per-rank CPU, NUMA and NIC binding map. Not the gradient exchange
(workflows/planning/exchange.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Closer first: same PCIe switch, switches, host bridge, same NUMA node, across sockets
# (nvidia-smi topo -m's legend; SOC is the old driver's name for SYS).
PCIE_DISTANCE = {"X": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5}
_TRAILING = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEGEND = re.compile(r"^\s*(NIC\d+):\s*(\S+)\s*$")
_NUMA_CPUS = re.compile(r"^NUMA node(\d+) CPU\(s\):\s*(\S*)\s*$")


@dataclass(frozen=True)
class GpuTopology:
    """One `nvidia-smi topo -m`: per GPU its distance to each NIC, CPU and NUMA affinity."""

    gpus: list[str]
    nics: list[str]
    """Device names (mlx5_0 ...): a newer driver's NIC0.. columns resolved by its NIC Legend."""
    distance: dict[str, dict[str, str]] = field(default_factory=dict)
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, int | None] = field(default_factory=dict)


def parse_topo(text: str) -> GpuTopology:
    """Parse `nvidia-smi topo -m`; ValueError when no GPU matrix is found."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    legend = {m.group(1): m.group(2) for m in map(_LEGEND.match, lines) if m}
    header_at = next((i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
    if header_at is None:
        raise ValueError("nvidia-smi topo -m: no header line starting with GPU0")
    header = lines[header_at]
    first_trailing = _TRAILING.search(header)
    matrix_cols = header[: first_trailing.start() if first_trailing else None].split()
    trailing = _TRAILING.findall(header)
    topo = GpuTopology(gpus=[], nics=[legend.get(c, c) for c in matrix_cols if not _is_gpu(c)])
    for line in lines[header_at + 1 :]:
        words = line.split()
        if not words or not _is_gpu(words[0]):
            continue
        _add_gpu_row(topo, words, matrix_cols, trailing, legend)
    return topo


def _is_gpu(name: str) -> bool:
    return re.fullmatch(r"GPU\d+", name) is not None


def _add_gpu_row(
    topo: GpuTopology, words: list[str], cols: list[str], trailing: list[str], legend: dict
) -> None:
    gpu, values, rest = words[0], words[1 : 1 + len(cols)], words[1 + len(cols) :]
    topo.gpus.append(gpu)
    pairs = zip(cols, values, strict=False)
    topo.distance[gpu] = {legend.get(c, c): v for c, v in pairs if not _is_gpu(c)}
    extra = dict(zip(trailing, rest, strict=False))  # N/A columns may be short
    topo.cpu_affinity[gpu] = extra.get("CPU Affinity", "")
    numa = extra.get("NUMA Affinity", "")
    topo.numa_affinity[gpu] = int(numa) if numa.isdigit() else None


@dataclass(frozen=True)
class CpuTopology:
    """What lscpu says: CPU count, sockets, threads per core and each NUMA node's CPU list."""

    cpus: int
    sockets: int
    threads_per_core: int
    numa_cpus: dict[int, str]
    model: str = ""


def parse_lscpu(text: str) -> CpuTopology:
    """Parse `lscpu` (the English, human form); ValueError without a CPU(s) line."""
    fields: dict[str, str] = {}
    numa: dict[int, str] = {}
    for line in text.splitlines():
        match = _NUMA_CPUS.match(line.strip())
        if match:
            numa[int(match.group(1))] = match.group(2)
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    if "CPU(s)" not in fields:
        raise ValueError("lscpu: no 'CPU(s):' line")
    return CpuTopology(
        cpus=int(fields["CPU(s)"]),
        sockets=int(fields.get("Socket(s)", "1") or 1),
        threads_per_core=int(fields.get("Thread(s) per core", "1") or 1),
        numa_cpus=numa,
        model=fields.get("Model name", ""),
    )


def parse_numactl(text: str) -> dict[int, str]:
    """`numactl -H`'s 'node N cpus: 0 1 2' lines -> {N: '0-2'} (CPU-less nodes are left out)."""
    out = {}
    for line in text.splitlines():
        match = re.match(r"^node (\d+) cpus:(.*)$", line.strip())
        if match and match.group(2).split():
            out[int(match.group(1))] = cpu_ranges(int(c) for c in match.group(2).split())
    return out


def cpu_ranges(cpus: Any) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the form lscpu and numactl --physcpubind use)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    for cpu in ordered:
        if parts and cpu == _last(parts) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


def _last(parts: list[str]) -> int:
    return int(parts[-1].split("-")[-1])


def numa_of_cpus(cpu_list: str, numa_cpus: dict[int, str]) -> int | None:
    """The NUMA node whose CPU list contains the first CPU of `cpu_list` (old drivers print
    only CPU Affinity)."""
    first = re.match(r"\d+", cpu_list)
    if first is None:
        return None
    cpu = int(first.group())
    for node, cpus in numa_cpus.items():
        if cpu in expand_cpus(cpus):
            return node
    return None


def expand_cpus(cpu_list: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, cpu_list.split(",")):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def derive_binding(
    gpu: GpuTopology, cpu: CpuTopology | None, compute_hcas: dict[str, int]
) -> list[dict[str, Any]]:
    """Per GPU (local rank): its NUMA node, that node's CPUs and the nearest compute HCA.

    `compute_hcas` maps each compute HCA to its port (storage HCAs already left out). Among
    HCAs at the same distance the one fewest GPUs use so far wins, then the first listed: on
    a DGX A100 two GPUs and two HCAs share a PCIe switch, one HCA each.
    """
    numa_cpus = cpu.numa_cpus if cpu else {}
    used = {hca: 0 for hca in compute_hcas}
    binding = []
    for rank, name in enumerate(gpu.gpus):
        numa = gpu.numa_affinity.get(name)
        if numa is None:
            numa = numa_of_cpus(gpu.cpu_affinity.get(name, ""), numa_cpus)
        entry: dict[str, Any] = {"local_rank": rank, "numa": numa if numa is not None else 0}
        cpus = numa_cpus.get(numa) if numa is not None else None
        cpus = cpus or gpu.cpu_affinity.get(name) or None
        if cpus and re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", cpus):
            entry["cpus"] = cpus
        hca = nearest_hca(gpu.distance.get(name, {}), used)
        if hca is not None:
            used[hca] += 1
            entry["hca"] = f"{hca}:{compute_hcas[hca]}"
        binding.append(entry)
    return binding


def nearest_hca(distances: dict[str, str], used: dict[str, int]) -> str | None:
    """The closest HCA of `used` (ties: least used, then listed first)."""
    order = list(used)
    candidates = [h for h in order if h in distances]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda h: (PCIE_DISTANCE.get(distances[h], 9), used[h], order.index(h)),
    )
