"""Login-node side of vitpod: cluster profiles, stage recipes, rendering, submission (no torch)."""
