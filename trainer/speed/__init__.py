"""Speed: precision, attention and outlook kernels, float8, torch.compile's cache."""
