"""`vitpod completion`: a static bash completion script made from the CLI's own command table.

Each command parses its own argv (workflows/cli.py's lazy table), so there is no one parser for
shtab or argcomplete to walk; instead each command's --help is read once, here, for its long
options. Install: `vitpod completion > ~/.local/share/bash-completion/completions/vitpod`
(or `source <(vitpod completion)`). Regenerate after an upgrade.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex

from vitpod.workflows.errors import ConfigError

_LONG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")

SCRIPT = """# bash completion for vitpod, made by `vitpod completion` (regenerate after an upgrade)
_vitpod() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}}
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W {commands} -- "$cur"))
    return
  fi
  local opts
  case ${{COMP_WORDS[1]}} in
{cases}
  esac
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
  else
    COMPREPLY=($(compgen -f -- "$cur"))  # run directories, files
  fi
}}
complete -o filenames -F _vitpod vitpod
"""


def options(command: str) -> list[str]:
    """The long options `vitpod COMMAND --help` prints (none when it cannot print them)."""
    from vitpod.workflows import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli._load(command)(["--help"])
        except SystemExit:
            pass
        except Exception:  # a command whose area is not installed here: names only
            return []
    # an option's own line starts with it (its help text may name other commands' options)
    heads = [ln.strip().split("  ")[0] for ln in out.getvalue().splitlines()]
    return sorted({o for head in heads if head.startswith("-") for o in _LONG.findall(head)})


def script() -> str:
    from vitpod.workflows import cli

    cases = "\n".join(
        f"    {shlex.quote(name)}) opts={shlex.quote(' '.join(options(name)))} ;;"
        for name in cli.COMMANDS
    )
    return SCRIPT.format(commands=shlex.quote(" ".join(cli.COMMANDS)), cases=cases)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv != ["bash"]:
        raise ConfigError(f"vitpod completion {' '.join(argv)}: only bash is generated; run "
                          "`vitpod completion` (or `vitpod completion bash`)")  # fmt: skip
    print(script(), end="")
    return 0
