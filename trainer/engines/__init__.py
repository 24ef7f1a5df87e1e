"""Gradient engines: DDP ring/PS, DeepSpeed, the DeviceMesh (FSDP2, TP, PP), commbench."""
