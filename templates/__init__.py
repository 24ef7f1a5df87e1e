"""Jinja templates of the batch script, its partials and the per-rank binding script."""
