"""What runs on a compute node besides the trainer (rank facts, doctor, probe, image check)."""
