"""`vitpod completion`: a static bash completion script made from the CLI's own command table.

Each command parses its own argv (workflows/cli.py's lazy table), so there is no one parser for
shtab or argcomplete to walk; instead each command's --help is read once, here, for its long
options. Profile options (--cluster ...) complete profile names (bundled, and the user's at
completion time), --model the recipes. Install:
`vitpod completion > ~/.local/share/bash-completion/completions/vitpod`
(or `source <(vitpod completion)`). Regenerate after an upgrade.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterable
from typing import Any

from vitpod.workflows.errors import ConfigError

_LONG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
PROFILE_OPTS = ("--cluster", "--finetune-cluster", "--profile", "--base", "--check")
"""Options whose value is a profile: completed with the bundled names and, when completing, the
user's ($VITPOD_PROFILES, default ~/.config/vitpod/profiles); --model with the recipes."""

SCRIPT = """# bash completion for vitpod, made by `vitpod completion` (regenerate after an upgrade)
_vitpod() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}}
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W {commands} -- "$cur"))
    return
  fi
  case ${{COMP_WORDS[COMP_CWORD-1]}} in
    {profile_opts})
      local names={profiles} f
      for f in "${{VITPOD_PROFILES:-$HOME/.config/vitpod/profiles}}"/*.yaml; do
        [ -e "$f" ] && names+=" $(basename "$f" .yaml)"
      done
      COMPREPLY=($(compgen -W "$names" -- "$cur"))
      return;;
    --model)
      COMPREPLY=($(compgen -W {models} -- "$cur"))
      return;;
  esac
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


def options(main: Callable[[list[str]], Any]) -> list[str]:
    """The long options a command's `main(["--help"])` prints (none when it cannot print them)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(["--help"])
        except SystemExit:
            pass
        except ImportError:  # a command whose area is not installed here: its name only
            return []
    # an option's own line starts with it (its help text may name other commands' options)
    heads = [ln.strip().split("  ")[0] for ln in out.getvalue().splitlines()]
    return sorted({o for head in heads if head.startswith("-") for o in _LONG.findall(head)})


def script(commands: Iterable[str], load: Callable[[str], Any]) -> str:
    """The script for `commands` (workflows/cli.py's table; `load`: a name's main)."""
    names = list(commands)
    cases = "\n".join(
        f"    {shlex.quote(name)}) opts={shlex.quote(' '.join(options(load(name))))} ;;"
        for name in names
    )
    from vitpod.workflows.planning.recipe import bundled_recipes
    from vitpod.workflows.site.profile import bundled_profiles

    return SCRIPT.format(
        commands=shlex.quote(" ".join(names)), cases=cases, profile_opts="|".join(PROFILE_OPTS),
        profiles=shlex.quote(" ".join(bundled_profiles())),
        models=shlex.quote(" ".join(bundled_recipes())),
    )  # fmt: skip


def main(argv: list[str], commands: Iterable[str], load: Callable[[str], Any]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv != ["bash"]:
        raise ConfigError(f"vitpod completion {' '.join(argv)}: only bash is generated; run "
                          "`vitpod completion` (or `vitpod completion bash`)")  # fmt: skip
    print(script(commands, load), end="")
    return 0
