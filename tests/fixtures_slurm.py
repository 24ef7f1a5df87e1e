"""Fixtures for the real local Slurm cluster (owned by the cluster area)."""
