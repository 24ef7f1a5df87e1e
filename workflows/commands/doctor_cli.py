"""`make doctor CLUSTER=...`: check a partition's nodes, name bad ones, submit without them."""

from __future__ import annotations

import argparse
import shlex
import subprocess
from dataclasses import dataclass

from vitpod.node.doctor import read_records
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.rundir import runs_root
from vitpod.workflows.planning import sbatchopts
from vitpod.workflows.planning.flags import request_flags
from vitpod.workflows.site import discover
from vitpod.workflows.site.doctor_step import doctor_argv
from vitpod.workflows.site.profile import Profile, load_profile

DOCTOR_TIME = "00:05:00"
SRUN_WAIT_S = 300  # queueing included: busy nodes make the doctor wait for them


@dataclass(frozen=True)
class Verdict:
    node: str
    bad: list[str]
    """One line per failed check; empty: the node is fine."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vitpod.workflows doctor", description=__doc__,
        parents=[request_flags("cluster", "stage", "model", "nodes", "args", "run-root",
                               args="more of these flags, shell-quoted (make ARGS=)",
                               nodes="nodes of the --auto-exclude submission")],
    )  # fmt: skip
    p.add_argument("--min-free-gb", type=float, default=5.0, help="free space each path needs")
    p.add_argument("--auto-exclude", action="store_true",
                   help="submit the stage with sbatch --exclude=<bad nodes>")  # fmt: skip
    p.add_argument("--train-args", default="", help="trainer flags of that submission")
    sbatchopts.add_flags(p)  # ACCOUNT=, QOS=, ...: the all-reduce job and the resubmission
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(argv)
    return parser.parse_args([*argv, *shlex.split(ns.args)]) if ns.args else ns


def slurm_verdicts(nodes: list[discover.NodeInfo]) -> list[Verdict]:
    """Nodes Slurm already knows are drained or down: named from scontrol, never run on."""
    out = []
    for n in nodes:
        if not n.usable:
            reason = f" (reason: {n.reason})" if n.reason else ""
            out.append(Verdict(n.name, [f"slurm state {n.state}{reason}; not run on it"]))
    return out


def node_verdicts(profile: Profile, ns: argparse.Namespace, nodes: list[str]) -> list[Verdict]:
    """One srun over `nodes` (one task each) running vitpod.node.doctor."""
    part, kind = profile.partition(ns.stage), profile.node_type(ns.stage)
    gres = [f"--gres=gpu:{kind.gpus_per_node}"] if kind.gpus_per_node else []  # see every GPU
    argv = doctor_argv(profile, kind,
                       str(runs_root(profile, ns.run_root)), ns.min_free_gb)  # fmt: skip
    cmd = ["srun", "-p", part.name, "-w", ",".join(nodes), f"-N{len(nodes)}",
           "--ntasks-per-node=1", f"--time={DOCTOR_TIME}", "--kill-on-bad-exit=0",
           "--job-name=vitpod-doctor", *gres, *argv]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=SRUN_WAIT_S)
    except subprocess.TimeoutExpired:
        why = f"no answer in {SRUN_WAIT_S} s (the nodes are busy, or srun hangs)"
        return [Verdict(node, [why]) for node in nodes]
    lines = out.stdout.splitlines()
    results = read_records(lines)
    for line in lines:
        if line.startswith("doctor: "):
            print(line)
    verdicts = []
    for node in nodes:
        checks = results.get(node)
        if checks is None:
            verdicts.append(
                Verdict(node, [f"no answer from the doctor: {out.stderr.strip()[-300:]}"])
            )
            continue
        bad = [f"{c['check']}: {c['detail']}" for c in checks if c["status"] == "bad"]
        verdicts.append(Verdict(node, bad))
    return verdicts


def allreduce(ns: argparse.Namespace, part_nodes: int, verdicts: list[Verdict]) -> bool:
    """The all-reduce check on the good nodes; True when it is flagged slow."""
    from vitpod.workflows.commands import doctor_allreduce

    bad = [v.node for v in verdicts if v.bad]
    good = min(part_nodes, len(verdicts) - len(bad))
    if good < 1:
        print("doctor: all-reduce: skipped: no good node")
        return False
    slow, line = doctor_allreduce.check(ns, bad, good)
    print(f"doctor: all-reduce: {'SLOW: ' if slow else ''}{line}")
    return slow


def run(ns: argparse.Namespace) -> tuple[list[Verdict], bool]:
    """Every node of the stage's partition: Slurm's state first, then the checks on the rest;
    then the all-reduce on the good ones (True: flagged slow)."""
    profile = load_profile(ns.cluster)
    if profile.scheduler != "slurm":
        raise ConfigError(f"CLUSTER={profile.name}: the doctor checks Slurm nodes; use a Slurm "
                          "profile")  # fmt: skip
    part = profile.partition(ns.stage)
    nodes = [n for n in discover.all_nodes() if part.name in n.partitions]
    if not nodes:
        raise ConfigError(f"partitions.{ns.stage}.name={part.name!r}: Slurm lists no such nodes")
    verdicts = slurm_verdicts(nodes)
    usable = [n.name for n in nodes if n.usable]
    if usable:
        verdicts += node_verdicts(profile, ns, usable)
    return verdicts, allreduce(ns, part.nodes, verdicts)


def resubmit(ns: argparse.Namespace, bad: list[str]) -> str:
    """The stage, planned and checked as `make pretrain` does, submitted without the bad nodes."""
    from vitpod.workflows.planning import preflight
    from vitpod.workflows.planning.plan import Request, plan_job
    from vitpod.workflows.submit.submission import submit_plan

    slurm = sbatchopts.excluding(sbatchopts.from_namespace(ns), bad)  # in the script itself
    plan = plan_job(Request(cluster=ns.cluster, model=ns.model, stage=ns.stage, nodes=ns.nodes,
                            args=ns.train_args, run_root=ns.run_root, time=ns.time,
                            slurm=slurm))  # fmt: skip
    checks = preflight.check(plan)
    job = submit_plan(plan, checks)
    print(f"submitted batch job {job.job_id} (--exclude={','.join(bad)})")
    print(job.script)
    return job.job_id


def main(argv: list[str]) -> int:
    ns = parse(argv)
    verdicts, slow = run(ns)
    bad = [v.node for v in verdicts if v.bad]
    for v in verdicts:
        for line in v.bad or ["all checks passed"]:
            print(f"doctor: {v.node}: {'BAD' if v.bad else 'ok'}: {line}")
    if not bad:
        print(
            f"doctor: {len(verdicts)} node(s) fine" + ("; the all-reduce is slow" if slow else "")
        )
        return 1 if slow else 0
    print(f"doctor: bad node(s): {','.join(bad)}")
    if ns.auto_exclude:
        resubmit(ns, bad)
        return 0
    good = min(len(verdicts) - len(bad), load_profile(ns.cluster).partition(ns.stage).nodes)
    flags = shlex.quote(f"--auto-exclude --nodes {good}") if good else "--auto-exclude"
    print(f"resubmit without them: make doctor CLUSTER={shlex.quote(ns.cluster)} "
          f"STAGE={ns.stage} ARGS={flags}   (sbatch --exclude={','.join(bad)})")  # fmt: skip
    return 1
