"""The request flags every workflows command shares, declared once (same types and defaults)."""

from __future__ import annotations

import argparse
from typing import Any

from vitpod.workflows.jobs.rundir import RUN_ROOT_ENV

# An empty string (what make passes for an unset variable) means "not given" for every flag.
REQUEST_FLAGS: dict[str, dict[str, Any]] = {
    "cluster": {"default": "local", "help": "bundled profile name or a YAML path"},
    "model": {
        "default": "",
        "help": "recipe name or YAML path (default: the profile's default_model)",
    },  # fmt: skip
    "stage": {"default": "pretrain", "choices": ("pretrain", "finetune")},
    "nodes": {"default": "", "help": "node count (default: the stage partition's)"},
    "time": {"default": "", "help": "Slurm time limit (default: the stage partition's)"},
    "args": {"default": "", "help": "extra flags for the ranks, shell-quoted"},
    "run-root": {"default": "", "help": f"override storage.runs (or ${RUN_ROOT_ENV})"},
    "timeout": {"type": float, "default": None, "help": "seconds to wait at most"},
}


def request_flags(*names: str, **helps: str) -> argparse.ArgumentParser:
    """A parent parser (argparse `parents=`) with the named flags; `helps` overrides a flag's
    help text for one command (keyword: the flag name with '_' for '-')."""
    parent = argparse.ArgumentParser(add_help=False)
    for name in names:
        options = dict(REQUEST_FLAGS[name])
        options["help"] = helps.get(name.replace("-", "_"), options.get("help"))
        parent.add_argument(f"--{name}", **options)
    return parent
