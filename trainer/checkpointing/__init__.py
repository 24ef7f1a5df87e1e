"""Checkpoints and resume: atomic async saves, DCP, universal, elastic, preemption."""
