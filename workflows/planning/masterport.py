"""MASTER_PORT per job: from the job id, below the node's ephemeral port range."""

from __future__ import annotations

from pathlib import Path

# MASTER_PORT = base + job id % span: concurrent jobs on a node differ, and the port stays below
# the node's ephemeral range (ip_local_port_range), where the kernel picks outgoing ports.
MASTER_PORT_BASE = 10000
MASTER_PORT_SPAN = 20000
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
EPHEMERAL_START = 32768  # Linux's default first ephemeral port, when the range cannot be read
MASTER_PORT_MIN_SPAN = 1000


def master_port_expr() -> str:
    """Shell arithmetic for MASTER_PORT from the job id (the formula of `master_port`); the
    setup lines set vitpod_span first (`master_port_span` read on the node)."""
    return f"$(( {MASTER_PORT_BASE} + SLURM_JOB_ID % vitpod_span ))"


def master_port_span_lines() -> list[str]:
    """Shell lines setting vitpod_span from this node's first ephemeral port."""
    b, s, m = MASTER_PORT_BASE, MASTER_PORT_SPAN, MASTER_PORT_MIN_SPAN
    return [
        f"vitpod_eph=$(cut -f1 {EPHEMERAL_RANGE} 2>/dev/null) || vitpod_eph={EPHEMERAL_START}",
        f"vitpod_span=$(( vitpod_eph - {b} > {s} ? {s} : "
        f"(vitpod_eph - {b} < {m} ? {m} : vitpod_eph - {b}) ))",
    ]


def master_port_span(ephemeral_start: int | None = None) -> int:
    """How many ports lie between the base and the ephemeral start (at most the span)."""
    if ephemeral_start is None:
        try:
            ephemeral_start = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            ephemeral_start = EPHEMERAL_START
    return min(MASTER_PORT_SPAN, max(MASTER_PORT_MIN_SPAN, ephemeral_start - MASTER_PORT_BASE))


def master_port(job_id: int) -> int:
    """MASTER_PORT of a job, in Python (submitit's local executor sets no Slurm variables)."""
    return MASTER_PORT_BASE + job_id % master_port_span()
