"""The preflight's Slurm-side checks: partition, usable nodes, GPUs, memory, CPUs, time, account."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.recipe import Recipe
from vitpod.workflows.planning.spec import JobSpec
from vitpod.workflows.site.profile import Profile
from vitpod.workflows.slurm.partitions import (
    OFFLINE_HINT,
    USABLE_STATES,
    NodeInfo,
    PartitionInfo,
    associations,
    cluster_partitions,
    partition_info,
)
from vitpod.workflows.slurm.quantities import slurm_minutes

_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


class Planned(Protocol):
    """What the preflight's checks read of a planned job (workflows/planning/plan.py's JobPlan
    has it); the cluster checks here read its spec and profile."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def profile(self) -> Profile: ...
    @property
    def recipe(self) -> Recipe: ...
    @property
    def trainer(self) -> dict[str, Any] | None: ...
    @property
    def script(self) -> str: ...


def mem_mb(mem: str) -> int:
    """Slurm's --mem in MB ('0': all of a node's memory, counted as 0 here)."""
    unit = mem[-1].upper() if mem and mem[-1].isalpha() else "M"
    number = mem[:-1] if mem and mem[-1].isalpha() else mem
    return int(int(number or 0) * _MB[unit])


def check_partition(plan: Planned) -> list[str]:
    """The stage's partition exists and has enough usable nodes with the GPUs, memory and CPUs
    a node of the job asks for, and a MaxTime that allows the job's time."""
    spec = plan.spec
    field = f"partitions.{spec.stage}"
    info = partition_info(spec.partition)
    if info is None:
        raise ConfigError(
            f"profile {spec.profile.name}: {field}.name={spec.partition!r} does not exist on "
            f"this cluster (sinfo lists {sorted(cluster_partitions())}); fix the profile"
        )
    _check_node_count(spec, info, field)
    fit = _check_resources(plan, info)
    want = slurm_minutes(spec.time)
    if info.max_minutes is not None and want > info.max_minutes:
        raise ConfigError(
            f"profile {spec.profile.name}: {field}.time={spec.time!r} exceeds partition "
            f"{spec.partition!r}'s MaxTime ({info.max_minutes} min); lower {field}.time"
        )
    limit = info.max_minutes if info.max_minutes is not None else "UNLIMITED"
    return [
        f"partition {spec.partition}: {len(info.usable)} usable of {info.total_nodes} node(s), "
        f"{fit} fit a node of the job ({spec.gpus_per_node} GPU(s), "
        f"{spec.tasks_per_node * spec.cpus_per_task} CPUs, --mem={spec.mem}), MaxTime {limit} min"
    ]


def _check_node_count(spec: JobSpec, info: PartitionInfo, field: str) -> None:
    limit = min(info.total_nodes, info.max_nodes or info.total_nodes)
    if (spec.nodes_max or spec.nodes) > limit:  # a range: its top end must fit too
        most = info.max_nodes or "UNLIMITED"
        raise ConfigError(
            f"NODES={spec.nodes_arg}: partition {spec.partition!r} can give a job at most {limit} "
            f"node(s) (Slurm: TotalNodes={info.total_nodes}, MaxNodes={most}); use "
            f"NODES={limit} or fewer, or another partition in {field}"
        )
    usable = info.usable
    if spec.nodes > len(usable):
        out = sorted(f"{n.name}:{n.state}" for n in info.nodes if not n.usable)
        raise ConfigError(
            f"NODES={spec.nodes}: partition {spec.partition!r} has {len(usable)} usable node(s) "
            f"now ({', '.join(out)} are not {'/'.join(USABLE_STATES)}); use "
            f"NODES={len(usable)} or fewer, or wait until they are resumed (sinfo -R says why)"
        )


def _check_resources(plan: Planned, info: PartitionInfo) -> int:
    """How many usable nodes can hold one node of the job; ConfigError when fewer than NODES,
    naming the first resource that runs short and the node-type field to fix."""
    spec = plan.spec
    node_type = f"node_types.{plan.profile.partition(spec.stage).node_type}"
    cpus = spec.tasks_per_node * spec.cpus_per_task
    mem = mem_mb(spec.mem)
    needs: list[tuple[str, int, str, Callable[[NodeInfo], int]]] = [
        ("gres gpu", spec.gpus_per_node, f"{node_type}.gpus_per_node", lambda n: n.gpus),
        ("RealMemory MB", mem, f"{node_type}.mem (the job's --mem={spec.mem})",
         lambda n: n.memory_mb),
        ("CPUTot", cpus, f"{node_type}.cpus_per_node or tasks_per_node (tasks_per_node x "
         f"cpus_per_task = {spec.tasks_per_node} x {spec.cpus_per_task})", lambda n: n.cpus),
    ]  # fmt: skip
    nodes: list[NodeInfo] = list(info.usable)
    for what, need, fix, have in needs:
        fit = [n for n in nodes if have(n) >= need]
        if len(fit) < spec.nodes:
            most = max((have(n) for n in nodes), default=0)
            raise ConfigError(
                f"profile {spec.profile.name}: a node of the job needs {need} {what} but "
                f"partition {spec.partition!r} offers at most {most} on its usable nodes "
                f"({len(fit)} fit, NODES={spec.nodes}); fix {fix}"
            )
        nodes = fit
    return len(nodes)


def check_account(spec: JobSpec) -> list[str]:
    """The job's account and QOS (the profile's, or ACCOUNT/QOS) must be an association of the
    user (sacctmgr)."""
    if not (spec.account or spec.qos):
        return []
    pairs = associations()
    if pairs is None:
        return ["account/qos: no Slurm accounting (sacctmgr) to check them against; not checked"]
    accounts = {a for a, _ in pairs}
    if spec.account and spec.account not in accounts:
        raise ConfigError(
            f"{_where(spec, 'account')}={spec.account!r} is not one of your Slurm accounts "
            f"{sorted(accounts)} (sacctmgr show assoc); {_fix(spec, 'account')}"
        )
    if spec.qos:
        allowed = {q for a, q in pairs if spec.account in (None, a)}
        if spec.qos not in allowed:
            raise ConfigError(
                f"{_where(spec, 'qos')}={spec.qos!r} is not allowed for account "
                f"{spec.account or '(default)'} (sacctmgr lists {sorted(allowed)}); "
                f"{_fix(spec, 'qos')}"
            )
    return [f"account {spec.account or '(default)'}, qos {spec.qos or '(default)'}: associated"]


def _where(spec: JobSpec, field: str) -> str:
    given = spec.sbatch_set_by.get(field)
    return given if given else f"profile {spec.profile.name}: {field}"


def _fix(spec: JobSpec, field: str) -> str:
    given = spec.sbatch_set_by.get(field)
    return f"give another {given}= or leave it unset" if given else f"fix {field} in the profile"


def check_test_only(spec: JobSpec, script: str) -> list[str]:
    """Slurm's own verdict on the rendered script, nothing queued: `sbatch --test-only` reads it
    from stdin (an account, QOS, reservation, constraint, node list or option Slurm refuses)."""
    said = ask_test_only(spec, script)
    return [f"sbatch --test-only accepts the script ({said.removeprefix('sbatch: ')})"]


def ask_test_only(spec: JobSpec, script: str) -> str:
    """What `sbatch --test-only` says of the script ('sbatch: Job 12 to start at 2026-...T...
    using 4 processors on nodes n[1-2] in partition p'); ConfigError when Slurm refuses it."""
    try:
        out = slurm.call(["sbatch", "--test-only"], input=script)
    except slurm.SlurmError as exc:
        raise ConfigError(f"{exc}; {OFFLINE_HINT}") from None
    said = " ".join((out.stderr + out.stdout).split())
    if out.returncode != 0:
        given = ", ".join(f"{v}={getattr(spec, k) if k != 'extra' else ' '.join(spec.sbatch_extra)}"
                          for k, v in spec.sbatch_set_by.items())  # fmt: skip
        fix = f"fix what it names ({given} given here, or the profile)" if given else (
            f"fix what it names in profile {spec.profile.name}"
        )  # fmt: skip
        raise ConfigError(f"sbatch --test-only refuses the job script: {said}; {fix}")
    return said


def mpi_types(listing: str) -> set[str]:
    """MPI plugin types in `srun --mpi=list` output (its 'srun: ' prefix on older Slurm too);
    a PMIx version (pmix_v4) counts as pmix as well."""
    types: set[str] = set()
    for line in listing.splitlines():
        word = line.strip().removeprefix("srun:").strip()
        if re.fullmatch(r"[a-z0-9_]+", word):
            types.add(word)
            if word.startswith("pmix_v"):
                types.add("pmix")
    for versions in re.findall(r"versions available:\s*(.+)", listing):
        types.update(v.strip() for v in versions.split(",") if v.strip())
    return types


def check_mpi(spec: JobSpec) -> list[str]:
    """The profile's `mpi:` is a plugin this Slurm has (`srun --mpi=list`); none given: nothing."""
    mpi = spec.profile.mpi
    if not mpi:
        return ["mpi: not set, srun gets no --mpi (torch.distributed env:// rendezvous)"]
    try:
        out = slurm.call(["srun", "--mpi=list"])
    except slurm.SlurmError as exc:
        raise ConfigError(f"mpi={mpi}: {exc}; {OFFLINE_HINT}") from None
    types = mpi_types(out.stdout + "\n" + out.stderr)
    if mpi not in types:
        raise ConfigError(
            f"profile {spec.profile.name}: mpi={mpi!r} is not an MPI plugin of this Slurm "
            f"(`srun --mpi=list`: {sorted(types) or 'nothing listed'}); remove `mpi:` (the "
            f"trainer needs no MPI) or name one of them"
        )
    return [f"mpi: --mpi={mpi} is listed by srun --mpi=list"]
