"""What runs inside one job on every rank: dist init, model, precision, optimizer, checkpoints."""
