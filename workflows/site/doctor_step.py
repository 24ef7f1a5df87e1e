"""The doctor's command for a profile's node type, and the batch-script step of `doctor: true`."""

from __future__ import annotations

import sys
from pathlib import Path

from vitpod import node
from vitpod.workflows.containers.container import sqsh_path
from vitpod.workflows.site.profile import NodeType, Profile, resolve_path
from vitpod.workflows.templating import render

# The folder of the node-side scripts (probe.py, doctor.py: the standard library only), in a
# checkout or site-packages on shared storage: a node's interpreter runs them by path, so the
# node needs no vitpod install.
NODE_SCRIPTS = Path(node.__file__).resolve().parent
BAD_NODE_EXIT = 3  # the job's status when a node fails its checks before training


def doctor_argv(profile: Profile, node: NodeType, run_root: str, min_free_gb: float) -> list[str]:
    """`<python> <NODE_SCRIPTS>/doctor.py ...` for one node: the host's interpreter (the doctor
    checks the host, so never the container's)."""
    python = (profile.python or sys.executable) if profile.container is None else "python3"
    image = profile.container.image if profile.container else ""
    hcas = ",".join(b.hca for b in node.binding if b.hca)
    return [
        python, str(NODE_SCRIPTS / "doctor.py"),
        "--gpus", str(node.gpus_per_node), "--hcas", hcas, "--run-root", run_root,
        "--image", (sqsh_path(image) or image) if image else "",
        "--min-free-gb", f"{min_free_gb:g}",
    ]  # fmt: skip


def setup_lines(profile: Profile, stage: str, run_dir: str, min_free_gb: float = 5.0) -> list[str]:
    """Shell lines that run the doctor once per node before the ranks start (doctor: true);
    empty when the profile does not ask for it."""
    if not profile.doctor or profile.scheduler != "slurm":
        return []
    root = str(Path(run_dir).parent) if run_dir else str(resolve_path(profile.storage.runs))
    argv = doctor_argv(profile, profile.node_type(stage), root, min_free_gb)
    text = render("partials/doctor.sh.j2", {"argv": argv, "exit_code": BAD_NODE_EXIT,
                                             "cluster": profile.name})  # fmt: skip
    return text.strip("\n").splitlines()
