"""Entry point: `python -m workflows <command> ...` (see workflows/cli.py for the commands)."""

import sys

from workflows.cli import main

sys.exit(main())
