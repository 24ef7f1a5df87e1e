"""A chain stage on the local profile (no scheduler): submitit's LocalExecutor runs the stage's
rendered script (job.sh: torchrun over the node's ranks), the file `make render` shows. Slurm
stages are sbatched as rendered (workflows/submit/submission.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import submitit
from submitit.helpers import CommandFunction

from vitpod.registry import runfiles
from vitpod.workflows.planning.plan import JobPlan
from vitpod.workflows.slurm.quantities import slurm_minutes


def local_job(plan: JobPlan) -> Any:
    """Start the stage's kept script on this machine; the submitit job (state, results,
    cancel) that runs it."""
    spec = plan.spec
    executor = submitit.LocalExecutor(Path(spec.run_dir) / runfiles.SUBMITIT)
    executor.update_parameters(timeout_min=slurm_minutes(spec.time))
    return executor.submit(CommandFunction(["bash", str(plan.script_path)], verbose=False,
                                           cwd=spec.code_dir))  # fmt: skip
