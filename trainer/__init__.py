"""What runs inside one job on every rank: distributed init, model, precision, optimizer, checkpoints."""
