"""vitpod: train timm Vision Transformers on Slurm GPU clusters in enroot/pyxis containers.

One import package over the layout's folders: pyproject.toml maps vitpod.workflows,
vitpod.trainer, vitpod.analysis, vitpod.registry and vitpod.templates to workflows/, trainer/,
... (package-dir), for a wheel, the image and an editable install (`make setup`) alike.
"""
