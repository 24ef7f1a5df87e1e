"""Jinja2 environment for templates/: StrictUndefined, and `q` (shlex.quote) for every value.

Every value a template writes into a shell goes through `q` (a comment and an #SBATCH line
included: `sbatch` for the latter); the only unfiltered expressions are lines of shell code the
project renders itself (tests/test_template_injection.py lists them and runs every template with
hostile values). A value that no quoting can carry (a newline in a comment or an #SBATCH line) is
a ValueError that names the template field.
"""

from __future__ import annotations

import re
import shlex
import traceback
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

from vitpod.workflows.errors import ConfigError

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "templates"  # the `templates` package


class UnsafeValue(ConfigError):
    """A value no quoting can carry into the script; `render` adds the field's name."""


def shell_word(value: object) -> str:
    """The one quoting of a value in a job script: shlex.quote, on one line (a newline would end
    the comment or #SBATCH line it may sit in, and nothing vitpod writes needs one)."""
    text = str(value)
    if any(c in text for c in "\n\r\0"):
        raise UnsafeValue(
            f"{text!r} contains a newline, carriage return or NUL, which a job script cannot "
            f"carry; remove it"
        )
    return shlex.quote(text)


def sbatch_value(value: object) -> str:
    """A value inside an #SBATCH line: sbatch splits on blanks, ends the line at an unquoted #,
    takes ' as a quote (Slurm 17.11+) and \\ as an escape, also inside double quotes."""
    text = str(value)
    if any(c in text for c in '"\n\r\0'):
        raise UnsafeValue(
            f"{text!r} cannot appear in an #SBATCH line (double quote or newline); remove it"
        )
    if any(c.isspace() or c in "#'\\" for c in text):
        return '"' + text.replace("\\", "\\\\") + '"'
    return text


def argv_lines(argv: Sequence[str]) -> list[str]:
    """Quoted argv as lines: the words before the first --flag, then one flag (+ value) each."""
    words = [shell_word(a) for a in argv]
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
    env.filters["q"] = shell_word
    env.filters["sbatch"] = sbatch_value
    env.filters["argv_lines"] = argv_lines
    return env


_EXPRESSION = re.compile(r"{{-?\s*(.*?)\s*-?}}")
_NAME = re.compile(r"\(?\s*([A-Za-z_][\w.]*)")  # the field an expression starts with


def _field(exc: BaseException) -> str:
    """`templates/X.j2:LINE field` of the template expression whose filter raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith(".j2")]
    lineno = frames[-1].lineno if frames else None
    if lineno is None:
        return "a template value"
    path = Path(frames[-1].filename)
    try:
        line = path.read_text().splitlines()[lineno - 1]
    except (OSError, IndexError):
        line = ""
    names = [_NAME.match(e) for e in _EXPRESSION.findall(line) if "|" in e]
    fields = " / ".join(m[1] for m in names if m) or "value"
    return f"{path.relative_to(TEMPLATE_DIR.parent)}:{lineno} {fields}"


def render(name: str, context: dict[str, Any]) -> str:
    """Render templates/<name> with `context`; an undefined name raises, and so does a value
    no quoting can carry (ValueError naming the field)."""
    try:
        return _environment().get_template(name).render(**context)
    except UnsafeValue as exc:
        raise UnsafeValue(f"{_field(exc)}: {exc}") from None
