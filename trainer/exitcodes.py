"""Process exit statuses shared by the trainer and the launchers (torch-free)."""

import signal

OK = 0
USAGE = 2  # bad configuration, reported before any rank trains
REQUEUE = 75  # preempted: every rank checkpointed; the sbatch script requeues the job (EX_TEMPFAIL)

# Signals that mean "checkpoint and requeue". SIGUSR1 is left alone: NCCL uses it.
PREEMPT_SIGNALS = ("SIGUSR2", "SIGTERM")


def killed_by_statuses() -> dict[str, int]:
    """A shell's exit status of a process each preemption signal killed: {"USR2": 140, ...}."""
    return {name[3:]: 128 + int(getattr(signal, name)) for name in PREEMPT_SIGNALS}
