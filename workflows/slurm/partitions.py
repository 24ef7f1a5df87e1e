"""What Slurm says about a partition, its nodes and the user's associations (sinfo, scontrol,
sacctmgr), for the preflight's cluster checks; Slurm not answering is an error, never a pass."""

from __future__ import annotations

import getpass
from dataclasses import dataclass

from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.slurm.quantities import slurm_minutes

USABLE_STATES = ("IDLE", "MIXED", "ALLOCATED", "COMPLETING", "PLANNED")
"""Node states a job can be given (sinfo %T); DOWN, DRAIN(ED/ING), FAIL... count as absent.
PLANNED is an idle node the backfill scheduler holds for a pending job: Slurm still takes a job
for it, and the flag stays until the next backfill pass (bf_interval, 30 s by default) even after
that job is cancelled (reframe-hpc/reframe#3361 made the same change)."""
OFFLINE_HINT = "or pass --offline (make OFFLINE=1) to render/preflight without cluster checks"


class SlurmSilent(ConfigError):
    """A Slurm query timed out or failed: nothing about the cluster is known."""


BAD_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "MAINT", "FUTURE", "POWER")
"""Flags of scontrol's State (IDLE+DRAIN, DOWN+NOT_RESPONDING, IDLE+POWERED_DOWN) that keep a
node from a job."""


@dataclass(frozen=True)
class NodeInfo:
    """One Slurm node, as sinfo -N (the preflight) or scontrol show node (profile discovery,
    which fills in the rest) reports it."""

    name: str
    state: str
    memory_mb: int
    cpus: int
    gres: str = "(null)"
    sockets: int = 1
    features: str = "(null)"
    reason: str = ""
    partitions: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return gres_gpu(self.gres)[1]

    @property
    def gpu_type(self) -> str:
        return gres_gpu(self.gres)[0]

    @property
    def usable(self) -> bool:
        # sinfo %T: a trailing '*' means the node does not respond, '~' powered off, '#'
        # powering up; '-' planned by the backfill scheduler (as 'mixed-'), which a job can
        # still be given. scontrol's State adds flags after '+' (IDLE+DRAIN).
        base, *flags = self.state.upper().split("+")
        bad = any(b in f for f in flags for b in BAD_STATES)
        return base.rstrip("-") in USABLE_STATES and not bad

    @property
    def kind(self) -> tuple[object, ...]:
        """Nodes with equal hardware facts are one node type."""
        return (self.cpus, self.sockets, self.memory_mb, self.gres, self.features)


@dataclass(frozen=True)
class PartitionInfo:
    """One Slurm partition and its nodes, as scontrol show partition and sinfo report them."""

    name: str
    total_nodes: int
    max_nodes: int | None
    max_time: str
    """Slurm's MaxTime as it says it ('2-00:00:00', 'UNLIMITED')."""
    nodes: tuple[NodeInfo, ...] = ()
    default: bool = False
    """sinfo marks it the default partition."""

    @classmethod
    def from_scontrol(
        cls, fields: dict[str, str], nodes: tuple[NodeInfo, ...], default: bool = False
    ) -> PartitionInfo:
        """From `scontrol show partition`'s fields for it."""
        max_nodes = fields.get("MaxNodes")
        return cls(name=fields["PartitionName"], total_nodes=int(fields.get("TotalNodes", "0")),
                   max_nodes=None if _unlimited(max_nodes) else int(str(max_nodes)),
                   max_time=fields.get("MaxTime", "UNLIMITED"), nodes=nodes,
                   default=default)  # fmt: skip

    @property
    def max_minutes(self) -> int | None:
        return None if _unlimited(self.max_time) else slurm_minutes(self.max_time)

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
    return PartitionInfo.from_scontrol(fields, partition_nodes(name))


def partition_nodes(name: str) -> tuple[NodeInfo, ...]:
    """Every node of the partition: state, RealMemory (MB), CPUTot and gres GPUs."""
    letters = {"node": "%N", "state": "%T", "mem": "%m", "cpus": "%c", "gres": "%G"}
    try:
        rows = slurm.sinfo(letters, "-N", "-p", name)
    except slurm.SlurmError as exc:
        raise _silent(exc) from None
    nodes = {
        r["node"]: NodeInfo(r["node"], r["state"], _int(r["mem"]), _int(r["cpus"]), r["gres"])
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
    return value in (None, "", "UNLIMITED", "INFINITE")


def _int(text: str) -> int:
    digits = text.strip().rstrip("+")
    return int(digits) if digits.isdigit() else 0


def gres_gpu(gres: str) -> tuple[str, int]:
    """A node's GPU type and count from its gres: 'gpu:a100:8(S:0-1)' -> ('a100', 8);
    'gpu:2' or 'gpu:8,shard:0' -> ('', 2), ('', 8); '(null)' -> ('', 0)."""
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            return (parts[1] if len(parts) == 3 else ""), int(parts[-1])
    return "", 0
