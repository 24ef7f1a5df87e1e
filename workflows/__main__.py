"""Entry point: `python -m vitpod.workflows <command> ...` (workflows/cli.py lists them)."""

import sys

from vitpod.workflows.cli import main

sys.exit(main())
