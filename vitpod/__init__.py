"""vitpod: train timm Vision Transformers on Slurm GPU clusters in enroot/pyxis containers."""

from pathlib import Path as _Path

# In a source checkout the subpackages keep the layout's top-level folders (workflows/,
# trainer/, analysis/, registry/, templates/) beside this one; an installed wheel has them
# inside it (pyproject's package-dir). Either way they import as vitpod.<name>.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "workflows" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))
