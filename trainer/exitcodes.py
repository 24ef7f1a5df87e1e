"""Process exit statuses shared by the trainer and the launchers (torch-free)."""

OK = 0
USAGE = 2  # bad configuration, reported before any rank trains
REQUEUE = 75  # preempted: every rank checkpointed; the sbatch script requeues the job (EX_TEMPFAIL)

# Signals that mean "checkpoint and requeue". SIGUSR1 is left alone: NCCL uses it.
PREEMPT_SIGNALS = ("SIGUSR2", "SIGTERM")
