"""What Slurm says about a partition, its nodes and the user's associations (sinfo, scontrol,
sacctmgr), for the preflight's cluster checks; Slurm not answering is an error, never a pass."""

from __future__ import annotations

import getpass
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from vitpod.workflows.errors import ConfigError
from vitpod.workflows.quantities import slurm_minutes

QUERY_TIMEOUT_S = 30
USABLE_STATES = ("IDLE", "MIXED", "ALLOCATED", "COMPLETING")
"""Node states a job can be given (sinfo %T); DOWN, DRAIN(ED/ING), FAIL... count as absent."""
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
        # A trailing '*' means the node does not respond; '~' powered off; '#' powering up.
        return self.state.upper().rstrip("+") in USABLE_STATES


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


def query(argv: list[str], missing_ok: str = "") -> str | None:
    """stdout of a Slurm command. SlurmSilent when it is missing, times out or fails, except a
    failure whose message contains `missing_ok` (e.g. 'not found'), which returns None."""
    what = shlex.join(argv)
    if shutil.which(argv[0]) is None:
        raise SlurmSilent(f"Slurm did not answer: {argv[0]} is not on PATH; {OFFLINE_HINT}")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmSilent(
            f"Slurm did not answer: `{what}` timed out after {QUERY_TIMEOUT_S} s; check the "
            f"controller (`scontrol ping`) and retry, {OFFLINE_HINT}"
        ) from None
    except OSError as exc:
        raise SlurmSilent(f"Slurm did not answer: `{what}`: {exc}; {OFFLINE_HINT}") from None
    if out.returncode == 0:
        return out.stdout
    message = (out.stderr.strip() or out.stdout.strip()).splitlines()
    if missing_ok and missing_ok in " ".join(message):
        return None
    raise SlurmSilent(
        f"Slurm did not answer: `{what}` exited {out.returncode} "
        f"({message[-1] if message else 'no message'}); check the controller (`scontrol ping`) "
        f"and retry, {OFFLINE_HINT}"
    )


def cluster_partitions() -> set[str]:
    """Partition names from sinfo."""
    return set((query(["sinfo", "-h", "-o", "%R"]) or "").split())


def partition_info(name: str) -> PartitionInfo | None:
    """scontrol's and sinfo's view of a partition (None: no such partition)."""
    out = query(["scontrol", "show", "partition", name, "--oneliner"], missing_ok="not found")
    if not out or "PartitionName=" not in out:
        return None
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return PartitionInfo(
        name=name,
        total_nodes=int(fields.get("TotalNodes", "0")),
        max_nodes=None if _unlimited(fields.get("MaxNodes")) else int(fields["MaxNodes"]),
        max_minutes=None if _unlimited(fields.get("MaxTime")) else slurm_minutes(fields["MaxTime"]),
        nodes=partition_nodes(name),
    )


def partition_nodes(name: str) -> tuple[NodeInfo, ...]:
    """Every node of the partition: state, RealMemory (MB), CPUTot and gres GPUs."""
    out = query(["sinfo", "-h", "-N", "-p", name, "-o", "%N|%T|%m|%c|%G"]) or ""
    nodes = {}
    for line in out.splitlines():
        node, state, mem, cpus, gres = (line.split("|") + [""] * 5)[:5]
        if node:
            nodes[node] = NodeInfo(node, state, _int(mem), _int(cpus), _gres_gpus(gres))
    return tuple(nodes.values())


def associations(user: str | None = None) -> set[tuple[str, str]] | None:
    """(account, qos) pairs the user may submit with; None when there is no accounting."""
    if shutil.which("sacctmgr") is None:
        return None
    user = user or getpass.getuser()
    argv = ["sacctmgr", "-nP", "show", "assoc", f"user={user}", "format=account,qos"]
    try:
        out = query(argv) or ""
    except SlurmSilent:
        return None  # no slurmdbd: Slurm itself cannot hold accounts against the job
    pairs = set()
    for line in out.splitlines():
        account, _, qos = line.partition("|")
        pairs |= {(account.strip(), q.strip()) for q in qos.split(",")}
    return pairs


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
