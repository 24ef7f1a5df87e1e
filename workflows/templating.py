"""Jinja2 environment for templates/: StrictUndefined, and `q` (shlex.quote) for every value."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"  # the `templates` package


def sbatch_value(value: object) -> str:
    """A value inside an #SBATCH line: sbatch splits on blanks and honours double quotes."""
    text = str(value)
    if any(c in text for c in '"\n\r'):
        raise ValueError(f"{text!r} cannot appear in an #SBATCH line (quote or newline)")
    return f'"{text}"' if any(c.isspace() for c in text) else text


def argv_lines(argv: Sequence[str]) -> list[str]:
    """Quoted argv as lines: the words before the first --flag, then one flag (+ value) each."""
    words = [shlex.quote(str(a)) for a in argv]
    head = next((i for i, w in enumerate(words) if w.startswith("--")), len(words))
    lines = [" ".join(words[:head])]
    i = head
    while i < len(words):
        takes_value = (
            words[i].startswith("-") and i + 1 < len(words) and not words[i + 1].startswith("-")
        )
        lines.append(" ".join(words[i : i + 2]) if takes_value else words[i])
        i += 2 if takes_value else 1
    return lines


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.filters["sbatch"] = sbatch_value
    env.filters["argv_lines"] = argv_lines
    return env


def render(name: str, context: dict[str, Any]) -> str:
    """Render templates/<name> with `context`; an undefined name raises."""
    return _environment().get_template(name).render(**context)
