"""Container images (pyxis/enroot): flags, preflight and in-job checks, registry refs."""
