"""Threads per rank from the CPUs bound to it: ranks bound to the same CPUs (or NUMA node)
split them, and each loader worker takes one (an sbatch an admin accepts: no oversubscription)."""

from __future__ import annotations

from vitpod.workflows.site.profile import NodeType

DEFAULT_LOADER_WORKERS = 4  # trainer/config.py TrainConfig.workers (-j/--workers)


def cpu_count(cpus: str) -> int:
    """CPUs in a list such as '48-63,176-191' (32)."""
    total = 0
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        total += int(high or low) - int(low) + 1
    return total


def loader_workers(command: tuple[str, ...]) -> int:
    """Data-loader worker processes per rank: the command's last -j/--workers, else the
    trainer's default (0 when the command is not the trainer or the labeler)."""
    value: str | None = None
    for i, arg in enumerate(command):
        if arg in ("-j", "--workers") and i + 1 < len(command):
            value = command[i + 1]
        elif arg.startswith("--workers="):
            value = arg.partition("=")[2]
        elif arg.startswith("-j") and arg[2:].isdigit():
            value = arg[2:]
    if value is not None and value.isdigit():
        return int(value)
    trains = any(m in command for m in ("vitpod.trainer", "vitpod.trainer.tokenlabels.label"))
    return DEFAULT_LOADER_WORKERS if trains else 0


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
