"""Run directories, their records and their jobs: what every layer above reads and writes."""
