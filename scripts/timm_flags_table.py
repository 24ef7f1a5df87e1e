"""Write (or --check) docs/trainer.md's table of timm train.py's options, generated from
vitpod.trainer.settings.timmoptions.OPTIONS, the one table the parser and `-c` use too."""

from __future__ import annotations

import sys
from pathlib import Path

from vitpod.trainer.settings.timmoptions import ACCEPTED, OPTIONS, TimmOption

DOC = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"
START, END = "<!-- timm-options:start -->", "<!-- timm-options:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(option: TimmOption) -> str:
    flags = ", ".join(f"`{f}`" for f in option.flags) or "`DATA` (positional)"
    if option.use == ACCEPTED:
        here = f"accepted: `{option.field}`"
    else:
        here = option.use
    return f"| {flags} | {here} | {_cell(option.why)} |"


def table() -> str:
    rows = [_row(o) for o in OPTIONS]
    counts = {use: sum(o.use == use for o in OPTIONS) for use in ("accepted", "no effect",
                                                                  "refused")}  # fmt: skip
    head = (f"All {len(OPTIONS)} options of timm's train.py: {counts['accepted']} accepted, "
            f"{counts['no effect']} accepted with no effect, {counts['refused']} refused unless "
            "at timm's default.\n\n| timm flag | here | note / why |\n|---|---|---|")  # fmt: skip
    return "\n".join([START, head, *rows, END])


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    if START not in text or END not in text:
        print(f"{DOC}: no {START} ... {END} block", file=sys.stderr)
        return 1
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    new = before + table() + after
    if "--check" in argv:
        if new != text:
            print(f"{DOC}'s timm table is stale: run python scripts/timm_flags_table.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
