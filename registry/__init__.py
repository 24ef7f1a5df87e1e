"""Facts every package shares: the model registry and the names of a run directory's files."""
