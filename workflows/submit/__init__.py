"""Submitting and asking Slurm: the client, job state, run directories, resume."""
