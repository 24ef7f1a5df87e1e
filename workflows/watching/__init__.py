"""Watching runs: status, follow, triage, goodput, job control and cleanup."""
