"""--checkpoint-every: a step count, or `auto`, which only the planner resolves."""

from __future__ import annotations

import argparse

AUTO = "auto"
"""--checkpoint-every auto: the planner's interval from save cost, step time and failure rate."""
AUTO_BY_HAND = (
    "--checkpoint-every auto: only the planner resolves it (make render/pretrain with "
    'ARGS="--checkpoint-every auto" writes checkpoint_every N into plan.json, from the measured '
    "save cost, step time and the partition's interruptions); started by hand, give "
    "--checkpoint-every N (steps) or 0 (epoch ends)"
)


def checkpoint_every_value(text: str) -> int | str:
    """--checkpoint-every: a step count (0 = epoch ends), or `auto` (resolved by the planner)."""
    if text == AUTO:
        return AUTO
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of steps (0 = epoch ends) or auto"
        )
    return steps
