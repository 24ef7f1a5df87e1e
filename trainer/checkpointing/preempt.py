"""Preemption: SIGUSR2/SIGTERM set a flag; all ranks agree on it at each step boundary."""

from __future__ import annotations

import logging
import os
import signal
import time
import types

from vitpod.trainer.exitcodes import PREEMPT_SIGNALS

log = logging.getLogger(__name__)
# Test-only: "STEP:SECONDS" holds every rank that long at the boundary after STEP, before the
# ranks agree, so a test's real signal (scancel --signal=USR2, kill) sent once STEP is logged
# lands at that boundary on purpose (an epoch's last step). Never set by vitpod itself.
HOLD_ENV = "VITPOD_TEST_HOLD_AT_STEP"


class Preemption:
    """Install with `install()` first thing in main (before torch is even imported, so a signal
    during imports, dist init or model build only sets the flag); ask `agreed()` before the
    first step and at every step boundary (a collective)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self.seen_after: int | None = None
        """The step whose boundary first found this rank's signal: it arrived after the boundary
        before (in that step, its data wait, an evaluation or a checkpoint)."""

    def install(self) -> None:
        for name in PREEMPT_SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        # Only set a flag: checkpointing inside a signal handler would race the training step.
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self, step: int) -> bool:
        """True on every rank as soon as any rank received a preemption signal; `step` is the
        last step done (the log line saying when this rank saw its signal names it)."""
        import torch
        import torch.distributed as dist

        _hold_for_test(step)
        if self.requested and self.seen_after is None:
            self.seen_after = step
            log.warning("%s seen at the boundary after step %d", self.signal_name, step)
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop and not self.requested:
            log.warning("another rank was preempted; stopping here too")
        return stop


def _hold_for_test(step: int) -> None:
    hold = os.environ.get(HOLD_ENV)
    if hold and int(hold.split(":")[0]) == step:
        time.sleep(float(hold.split(":")[1]))
