"""Node ranges (`nodes: MIN-MAX`): the global batch the job keeps on whatever Slurm gives it; and
a job of fewer ranks than its nodes hold."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vitpod.workflows.errors import ConfigError

if TYPE_CHECKING:
    from vitpod.trainer.config import TrainConfig


def pinned(batch_size: int, global_batch: int) -> dict[str, Any]:
    """Trainer settings that keep a global batch on any node count: the ranks take the
    accumulation G / (dp x -b) for the world size they get (trainer/checkpointing/elastic.py)."""
    return {"batch_size": batch_size, "global_batch": global_batch, "elastic": True}


def check_range(cfg: TrainConfig, low: int, high: int, ranks_per_node: int) -> None:
    """Every node count in low..high must split the global batch; else name those that do."""
    per_replica = max(1, cfg.tp * cfg.pp)
    global_batch, batch = cfg.global_batch_size, cfg.batch_size

    def splits(nodes: int) -> bool:
        world = nodes * ranks_per_node
        dp = world // per_replica
        return world % per_replica == 0 and global_batch % (dp * batch) == 0

    bad = [n for n in range(low, high + 1) if not splits(n)]
    if bad:
        good = [n for n in range(low, high + 1) if splits(n)]
        raise ConfigError(
            f"nodes {low}-{high}: global batch {global_batch} (-b {batch}) does not split over "
            f"{', '.join(map(str, bad))} node(s) x {ranks_per_node} rank(s); node counts that "
            f"work: {', '.join(map(str, good)) or 'none'} (narrow the range or change -b)"
        )


def part_of_nodes(ranks: int | None, nodes: int, per_node: int, gpus: int) -> tuple[int, int]:
    """(tasks, GPUs) a node: a job of fewer ranks than its nodes hold (a sweep point: 1 GPU of an
    8-GPU node) asks Slurm for those ranks only; any other job for whole nodes."""
    if not ranks or ranks >= nodes * per_node:
        return per_node, gpus
    tasks = -(-ranks // nodes)
    return tasks, tasks * gpus // per_node if gpus else 0
