"""Threads per rank from the CPUs bound to it: ranks bound to the same CPUs (or NUMA node)
split them, and each loader worker takes one (an sbatch an admin accepts: no oversubscription)."""

from __future__ import annotations

from vitpod.workflows.site.profile import NodeType


def cpu_count(cpus: str) -> int:
    """CPUs in a list such as '48-63,176-191' (32)."""
    total = 0
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        total += int(high or low) - int(low) + 1
    return total


def rank_threads(node: NodeType, workers: int) -> dict[int, int]:
    """OMP_NUM_THREADS per local rank: the CPUs bound to it, split among the ranks bound to the
    same CPUs (or NUMA node), minus its loader workers (one CPU each), at least 1. Without a
    binding map a rank has cpus_per_node / ranks."""
    ranks = range(node.ranks_per_node)
    if not node.binding:
        return {r: max(1, node.cpus_per_task - workers) for r in ranks}
    key = {b.local_rank: (b.cpus or f"numa{b.numa}") for b in node.binding}
    numa_nodes = len({b.numa for b in node.binding})
    out = {}
    for b in node.binding:
        cores = cpu_count(b.cpus) if b.cpus else max(1, node.cpus_per_node // numa_nodes)
        sharing = sum(1 for k in key.values() if k == key[b.local_rank])
        out[b.local_rank] = max(1, cores // sharing - workers)
    return out
