"""What Slurm says about a partition, its nodes and the user's associations (sinfo, scontrol,
sacctmgr), for the preflight's cluster checks; Slurm not answering is an error, never a pass."""

from __future__ import annotations

import getpass
from dataclasses import dataclass

from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.quantities import slurm_minutes
from vitpod.workflows.submit import slurm

USABLE_STATES = ("IDLE", "MIXED", "ALLOCATED", "COMPLETING", "PLANNED")
"""Node states a job can be given (sinfo %T); DOWN, DRAIN(ED/ING), FAIL... count as absent.
PLANNED is an idle node the backfill scheduler holds for a pending job: Slurm still takes a job
for it, and the flag stays until the next backfill pass (bf_interval, 30 s by default) even after
that job is cancelled (reframe-hpc/reframe#3361 made the same change)."""
OFFLINE_HINT = "or pass --offline (make OFFLINE=1) to render/preflight without cluster checks"


class SlurmSilent(ConfigError):
    """A Slurm query timed out or failed: nothing about the cluster is known."""


@dataclass(frozen=True)
class NodeInfo:
    """One node of a partition as sinfo sees it."""

    name: str
    state: str
    memory_mb: int
    cpus: int
    gpus: int

    @property
    def usable(self) -> bool:
        # A trailing '*' means the node does not respond; '~' powered off; '#' powering up;
        # '-' planned by the backfill scheduler (as 'mixed-'), which a job can still be given.
        return self.state.upper().rstrip("+-") in USABLE_STATES


@dataclass(frozen=True)
class PartitionInfo:
    """What Slurm says about one partition."""

    name: str
    total_nodes: int
    max_nodes: int | None
    max_minutes: int | None
    nodes: tuple[NodeInfo, ...] = ()

    @property
    def usable(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.usable)

    @property
    def gpus_per_node(self) -> int:
        """GPUs of the poorest usable node (0 when none is usable)."""
        return min((n.gpus for n in self.usable), default=0)


def _silent(exc: slurm.SlurmError) -> SlurmSilent:
    return SlurmSilent(f"Slurm did not answer: {exc}; check the controller (`scontrol ping`) "
                       f"and retry, {OFFLINE_HINT}")  # fmt: skip


def cluster_partitions() -> set[str]:
    """Partition names from sinfo."""
    try:
        return {row["partition"] for row in slurm.sinfo({"partition": "%R"})}
    except slurm.SlurmError as exc:
        raise _silent(exc) from None


def partition_info(name: str) -> PartitionInfo | None:
    """scontrol's and sinfo's view of a partition (None: no such partition)."""
    try:
        found = slurm.scontrol_show("partition", name)
    except slurm.SlurmError as exc:
        raise _silent(exc) from None
    fields = next((f for f in found if f.get("PartitionName") == name), None)
    if fields is None:
        return None
    return PartitionInfo(
        name=name,
        total_nodes=int(fields.get("TotalNodes", "0")),
        max_nodes=None if _unlimited(fields.get("MaxNodes")) else int(fields["MaxNodes"]),
        max_minutes=None if _unlimited(fields.get("MaxTime")) else slurm_minutes(fields["MaxTime"]),
        nodes=partition_nodes(name),
    )


def partition_nodes(name: str) -> tuple[NodeInfo, ...]:
    """Every node of the partition: state, RealMemory (MB), CPUTot and gres GPUs."""
    letters = {"node": "%N", "state": "%T", "mem": "%m", "cpus": "%c", "gres": "%G"}
    try:
        rows = slurm.sinfo(letters, "-N", "-p", name)
    except slurm.SlurmError as exc:
        raise _silent(exc) from None
    nodes = {
        r["node"]: NodeInfo(
            r["node"], r["state"], _int(r["mem"]), _int(r["cpus"]), _gres_gpus(r["gres"])
        )
        for r in rows
        if r["node"]
    }
    return tuple(nodes.values())


def associations(user: str | None = None) -> set[tuple[str, str]] | None:
    """(account, qos) pairs the user may submit with; None when there is no accounting."""
    try:
        rows = slurm.sacctmgr_assoc(user or getpass.getuser(), ("account", "qos"))
    except slurm.SlurmError:
        return None  # no sacctmgr or no slurmdbd: Slurm itself cannot hold accounts against the job
    return {(r["account"].strip(), q.strip()) for r in rows for q in r["qos"].split(",")}


def _unlimited(value: str | None) -> bool:
    return value in (None, "UNLIMITED", "INFINITE")


def _int(text: str) -> int:
    digits = text.strip().rstrip("+")
    return int(digits) if digits.isdigit() else 0


def _gres_gpus(gres: str) -> int:
    """'gpu:2', 'gpu:a100:8(S:0-1)', 'gpu:8,shard:0' -> GPUs a node; '(null)' -> 0."""
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            return int(parts[-1])
    return 0
