"""What a run reports: metrics (JSONL, TensorBoard, W&B), MFU, timings, sample digests."""
