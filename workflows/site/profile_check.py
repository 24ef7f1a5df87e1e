"""`vitpod profile --check`: each way a profile disagrees with what Slurm and the nodes report."""

from __future__ import annotations

from typing import Any

from vitpod.workflows.site.profile import Profile
from vitpod.workflows.site.profile_writer import Discovered
from vitpod.workflows.slurm.quantities import slurm_minutes

NODE_KEYS = ("gpus_per_node", "cpus_per_node")
BINDING_KEYS = ("numa", "cpus", "hca")


def disagreements(profile: Profile, found: Discovered) -> list[str]:
    """One line each: `field: profile <value>, node <value>`."""
    out: list[str] = []
    seen: set[str] = set()
    for stage, part in profile.partitions.items():
        got = found.partitions.get(stage)
        if got is None:
            continue
        field = f"partitions.{stage}"
        if part.node_limit > got["max_nodes"]:
            key = "max_nodes" if part.max_nodes else "nodes"
            out.append(f"{field}.{key}: profile {part.node_limit}, Slurm {got['max_nodes']}")
        limit = found.max_minutes.get(stage)
        if limit is not None and slurm_minutes(part.time) > limit:
            out.append(f"{field}.time: profile {part.time}, Slurm MaxTime {limit} min")
        if part.node_type in seen:
            continue
        seen.add(part.node_type)
        node = profile.node_types[part.node_type].model_dump()
        out += node_disagreements(f"node_types.{part.node_type}", node,
                                  found.node_types[got["node_type"]])  # fmt: skip
    return out


def node_disagreements(field: str, mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    out = [
        f"{field}.{key}: profile {mine[key]}, node {theirs[key]}"
        for key in NODE_KEYS
        if mine[key] != theirs[key]
    ]
    model = (mine.get("gpu") or {}).get("model")
    node_model = (theirs.get("gpu") or {}).get("model")
    if model != node_model and (model or node_model):
        out.append(f"{field}.gpu.model: profile {model}, node {node_model}")
    theirs_by_rank = {b["local_rank"]: b for b in theirs.get("binding", [])}
    for entry in mine.get("binding", []):
        rank = entry["local_rank"]
        other = theirs_by_rank.get(rank)
        if other is None:
            if theirs_by_rank:
                out.append(f"{field}.binding[{rank}]: profile local rank {rank}, node none")
            continue
        for key in BINDING_KEYS:
            if entry.get(key) is not None and entry.get(key) != other.get(key):
                out.append(
                    f"{field}.binding[{rank}].{key}: profile {entry[key]}, node {other.get(key)}"
                )
    return out
