"""Which Slurm cluster ran a run, and asking each cluster about its own jobs.

A run's manifest keeps its profile, whose `cluster` names the Slurm cluster (absent: the default
one, SLURM_CONF's). Two clusters number their jobs independently, so a job id means nothing
without its cluster: every question about a set of runs is asked once per cluster, with -M
(workflows/slurm/__init__.py on_cluster), and each run's answer is read from its own cluster's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.jobs import jobstate

T = TypeVar("T")
DEFAULT = ""
"""The default cluster's key (a profile without `cluster:`)."""


def cluster_of(run_dir: Path | None) -> str:
    """The Slurm cluster named by the run's profile; DEFAULT when none (or no manifest yet)."""
    if run_dir is None:
        return DEFAULT
    try:
        manifest = runfiles.read_manifest(run_dir)
    except (OSError, ValueError):
        return DEFAULT
    return str(manifest.get("profile", {}).get("values", {}).get("cluster") or DEFAULT)


def shown(cluster: str) -> str:
    """A cluster for people: its name, or 'default' (SLURM_CONF's)."""
    return cluster or "default"


def per_cluster(
    runs: Sequence[tuple[Path | None, list[str]]], ask: Callable[[list[str]], T]
) -> list[T]:
    """`ask(job ids)` once per cluster, under -M, for the jobs of the runs on it; each run's
    answer is its cluster's (index-aligned with `runs`)."""
    clusters = [cluster_of(run_dir) for run_dir, _ in runs]
    answers: dict[str, T] = {}
    for cluster in dict.fromkeys(clusters):
        ids = list(dict.fromkeys(j for (_, job_ids), c in zip(runs, clusters, strict=True)
                                 if c == cluster for j in job_ids))  # fmt: skip
        with slurm.on_cluster(cluster or slurm.current_cluster()):
            answers[cluster] = ask(ids)
    return [answers[c] for c in clusters]


def poll(runs: Sequence[tuple[Path | None, list[str]]]) -> list[dict[str, jobstate.JobInfo]]:
    """Each run's jobs' states, one squeue (+ sacct for the gone) per cluster."""
    return per_cluster(runs, lambda ids: jobstate.poll_once(ids) if ids else {})
