"""A pipeline's per-stage resources: the node count and time limit each stage takes, who set
them (the table: docs/workflows.md#per-stage-resources), and the offline render of its stages."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypedDict

from vitpod.workflows.jobs.rundir import DIR_MODE, remove_run_dir
from vitpod.workflows.planning.sbatchopts import SbatchOptions
from vitpod.workflows.site.profile import Profile
from vitpod.workflows.submit.submission import materialize


class StageFields(TypedDict):
    """A stage's Request fields: its node count and time limit, and the variables that set them."""

    nodes: str
    nodes_name: str
    time: str
    time_name: str
    slurm: SbatchOptions


@dataclasses.dataclass(frozen=True)
class StageResources:
    """NODES/TIME/ACCOUNT/... (every stage) and FT_NODES/FT_TIME/FT_ACCOUNT/... (the
    fine-tune's, winning field by field); '' = not given."""

    nodes: str = ""
    time: str = ""
    finetune_nodes: str = ""
    finetune_time: str = ""
    slurm: SbatchOptions = SbatchOptions()
    finetune_slurm: SbatchOptions = SbatchOptions()

    def request(self, stage: str, profile: Profile, with_pretrain: bool) -> StageFields:
        """The stage's Request fields: nodes, time and the variable names errors use. NODES
        beyond the fine-tune's partition is the pretrain's only when the pretrain runs too:
        the fine-tune then takes its partition's count, and one line says so."""
        fine = stage == "finetune"
        time, time_name = (self.finetune_time, "FT_TIME") if fine and self.finetune_time else (
            self.time, "TIME"
        )  # fmt: skip
        nodes, nodes_name = self.nodes, "NODES"
        if fine and self.finetune_nodes:
            nodes, nodes_name = self.finetune_nodes, "FT_NODES"
        elif fine and with_pretrain and self.nodes.isdigit():
            part = profile.partition(stage)
            if int(self.nodes) > part.node_limit:
                print(f"finetune: NODES={self.nodes} is the pretrain's; partition {part.name!r} "
                      f"has {part.node_limit} node(s), so the finetune takes its {part.nodes} "
                      "(FT_NODES= sets it)", flush=True)  # fmt: skip
                nodes, nodes_name = "", "FT_NODES"
        slurm = self.finetune_slurm.over(self.slurm) if fine else self.slurm
        return {"nodes": nodes, "nodes_name": nodes_name, "time": time, "time_name": time_name,
                "slurm": slurm}  # fmt: skip


def write_rendered(
    directory: Path, label_jobs: Mapping[str, Any], records: Mapping[str, Any],
    manifest: Callable[[Any], dict[str, Any]],
) -> dict[str, Path]:  # fmt: skip
    """OFFLINE: every stage's run directory (script, bind.sh, plan.json, manifest.json; a
    labeling array's too) in a new pipeline directory, nothing submitted; each script's path.
    Nothing is left on failure."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=DIR_MODE)
    written: dict[str, Path] = {}
    try:
        for stage, job in label_jobs.items():
            plan = dataclasses.replace(job.plan, script=job.script)
            written[f"labels-{stage}"] = materialize(plan, job.manifest())
        for rec in records.values():
            written[rec.name] = materialize(rec.plan, manifest(rec))
            rec.recorded = "RENDERED"  # the stage's JobState (workflows/jobs/jobstate.py)
    except BaseException:
        remove_run_dir(directory)
        raise
    return written
