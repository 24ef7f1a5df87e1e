"""No injection: every template rendered with hostile values, its shell run, nothing extra runs.

Each value a template writes into a shell goes through one quoting filter (`q`, or `sbatch` in an
#SBATCH line; workflows/templating.py). Here every script vitpod renders (job.sbatch with
the container start, doctor and credentials lines, bind.sh, the local torchrun script, a scaling
study's point jobs and its report job) is rendered through the project's own functions with
paths, profile values and ARGS full of `$( )`, backticks, quotes, `;`, `&&` and `|`, then run by
bash with the Slurm commands stubbed (tiny scripts on PATH that record their argv and exit 0).
Each payload runs `touch $P`: the marker file must not exist afterwards, and the stubs must have
received the hostile values byte for byte. A newline, which no quoting carries into a comment or
an #SBATCH line, is a ValueError naming the template field. The study path of issue 30 (finding
9) is one of the cases.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import HOSTILE, hostile_profile
from vitpod.registry import runfiles
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.site.profile import PROFILE_DIR
from vitpod.workflows.studies import reportjob, scaling
from vitpod.workflows.templating import TEMPLATE_DIR, render

# Every payload touches $P (the marker) if it ever reaches a shell unquoted, in double quotes or
# past a single quote. No double quote, '%', '\\' or newline: run paths refuse those up front.
STUBS = (
    "srun",
    "scontrol",
    "sbatch",
    "squeue",
    "scancel",
    "sacct",
    "sinfo",
    "enroot",
    "numactl",
    "python3",
)  # python3: the container interpreter bind.sh runs (imagecheck)
STUB = r"""#!/bin/bash
# Slurm stand-in: record argv (fields \x1f, calls \x1e) and succeed.
{ printf '%s' "${0##*/}"; printf '\x1f%s' "$@"; printf '\x1e'; } >>"$STUB_LOG"
case "${0##*/}" in
  scontrol) [ "$1 $2" = "show hostnames" ] && echo node1 ;;
  srun) [ -n "${STUB_FAIL_DOCTOR:-}" ] && [[ "$*" == *--job-name=vitpod-doctor* ]] && exit 1 ;;
  numactl) while [[ "${1:-}" == --* ]]; do shift; done; exec "$@" ;;
esac
exit 0
"""
# Unfiltered template expressions: lines of shell the project renders itself, constants and
# validated variable names (profile env/secret names match ^[A-Za-z_][A-Za-z0-9_]*$).
CODE_EXPRESSIONS = {
    "line",  # setup/teardown lines and argv_lines output, themselves rendered with `q`
    "spec.requeue_marker",  # a shell word built with shlex.quote (spec.py)
    "marker_env",  # the constant VITPOD_REQUEUE_MARKER
    "master_port",  # master_port_expr(): an arithmetic expression of $SLURM_JOB_ID
    "name",  # an environment variable name, validated by the profile
    '" \\\\" if not loop.last',
    '"--requeue" if spec.requeue else "--no-requeue"',
    "points | length",
}


def _stubs(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "stubs"
    bin_dir.mkdir()
    for name in STUBS:
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STUB_LOG": str(tmp_path / "stub.log"),
        "P": str(tmp_path / "PWNED"),
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
    }


def _calls(env: dict[str, str]) -> list[list[str]]:
    log = Path(env["STUB_LOG"])
    text = log.read_text() if log.exists() else ""
    return [call.split("\x1f") for call in text.split("\x1e") if call]


def _run(script: Path | str, env: dict[str, str], *args: str, **extra: str) -> int:
    """bash SCRIPT ARGS with the stubs; the marker must not exist after (its rc is returned)."""
    out = subprocess.run(
        ["bash", str(script), *args], env={**env, **extra}, capture_output=True, text=True,
        timeout=60, cwd=Path(env["P"]).parent,
    )  # fmt: skip
    assert not Path(env["P"]).exists(), f"a payload ran in {script}:\n{out.stdout}\n{out.stderr}"
    return out.returncode


def _slurm_job(**over: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1",
        "SLURM_RESTART_COUNT": "0", **over,
    }  # fmt: skip


def _slurm_profile(tmp_path: Path, **changes: Any) -> tuple[Path, Path]:
    """localregistry (container, start_once, registry credentials) plus doctor: true."""
    root = tmp_path / f"root{HOSTILE}"
    container = yaml.safe_load((PROFILE_DIR / "localregistry.yaml").read_text())["container"]
    container.update(mounts=[{"src": str(root), "dst": str(root)}], workdir=f"{root}/code",
                     python="python3")  # fmt: skip
    return hostile_profile(tmp_path, "localregistry", container=container, doctor=True, **changes)


def _args() -> str:
    return f"--wandb-name {shlex.quote(HOSTILE)}"


def test_every_template_expression_is_quoted_or_project_code():
    """A new `{{ value }}` without `| q` (or `| sbatch` in an #SBATCH line) fails here."""
    loose = []
    for path in sorted(TEMPLATE_DIR.rglob("*.j2")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for expr in re.findall(r"{{-?\s*(.*?)\s*-?}}", line):
                filtered = re.search(r"\|\s*(q|sbatch)\s*$", expr) or 'map("q")' in expr
                if not filtered and expr not in CODE_EXPRESSIONS:
                    loose.append(f"{path.relative_to(TEMPLATE_DIR)}:{n}: {{{{ {expr} }}}}")
                if line.startswith("#SBATCH") and expr.endswith("| q"):
                    loose.append(f"{path.relative_to(TEMPLATE_DIR)}:{n}: #SBATCH needs | sbatch")
    assert not loose, "unquoted template values:\n" + "\n".join(loose)


def test_sbatch_job_bind_doctor_and_container_lines_run_nothing_hostile(tmp_path):
    env = _stubs(tmp_path)
    cluster, root = _slurm_profile(tmp_path)
    run_dir = root / "runs" / f"run{HOSTILE}"
    plan = plan_job(Request(cluster=str(cluster), model="", stage="pretrain", nodes=1,
                            args=_args(), run_dir=run_dir))  # fmt: skip
    assert "make doctor CLUSTER=" in plan.script and "VITPOD_START_JSON=" in plan.script
    assert "ENROOT_CONFIG_PATH" in plan.script  # the credentials lines are part of the run
    (run_dir / runfiles.LOGS).mkdir(parents=True)
    (run_dir / "job.sbatch").write_text(plan.script)
    plan.launch.write_bind_script()

    assert _run(run_dir / "job.sbatch", env, **_slurm_job()) == 0
    calls = _calls(env)
    train = [c for c in calls if c[0] == "srun" and str(run_dir / "bind.sh") in c]
    assert len(train) == 1, calls
    # the ranks' argv reaches srun byte for byte: bind.sh and the plan at the hostile run path;
    # ARGS reach the ranks through plan.json, and the script's log shows them (the echo lines)
    assert train[0][-len(plan.launch.argv) :] == list(plan.launch.argv)
    assert train[0][-1] == str(run_dir / runfiles.PLAN)
    assert f"--container-workdir={root}/code" in train[0]
    assert plan.decision.trainer.run["wandb_name"] == HOSTILE
    log = next((run_dir / runfiles.LOGS).glob("sbatch-*.log")).read_text()
    assert f'"wandb_name": "{HOSTILE}"' in log
    doctor = [c for c in calls if "--job-name=vitpod-doctor" in c]
    assert doctor and f"{root}/runs" in doctor[0]  # the doctor's --run-root
    assert (run_dir / runfiles.CONTAINER_START).is_file()  # written to the hostile path
    assert not (run_dir / runfiles.ENROOT_CONFIG).exists()  # the teardown removed it

    # A node that fails the doctor: the job ends (exit 3) through the message naming CLUSTER.
    Path(env["STUB_LOG"]).unlink()
    assert _run(run_dir / "job.sbatch", env, **_slurm_job(), STUB_FAIL_DOCTOR="1") == 3
    assert not any(c for c in _calls(env) if str(run_dir / "bind.sh") in c)

    # bind.sh on a rank: the command exits 75, so it leaves the requeue marker at the hostile path
    # and exits 0 (a preempted rank is no bad exit for srun --kill-on-bad-exit=1).
    rank = {"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    rc = _run(run_dir / "bind.sh", env, "bash", "-c", "exit 75", **_slurm_job(), **rank)
    assert rc == 0
    assert (run_dir / runfiles.LOGS / "requeue-41-restart0").is_file()


def test_local_script_runs_nothing_hostile(tmp_path):
    env = _stubs(tmp_path)
    python = tmp_path / f"py{HOSTILE}" / "python"
    python.parent.mkdir()
    python.write_text(STUB)  # the profile's interpreter, at a hostile path, records its argv
    python.chmod(0o755)
    cluster, root = hostile_profile(tmp_path, "local", python=str(python))
    run_dir = root / "runs" / f"run{HOSTILE}"
    plan = plan_job(Request(cluster=str(cluster), model="", stage="pretrain", nodes=1,
                            args=_args(), run_dir=run_dir))  # fmt: skip
    (run_dir / runfiles.LOGS).mkdir(parents=True)
    (run_dir / "run.sh").write_text(plan.script)
    assert _run(run_dir / "run.sh", env) == 0
    (call,) = _calls(env)
    assert call[0] == "python" and call[-1] == str(run_dir / runfiles.PLAN)
    assert call[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert call[5:] == list(plan.spec.rank_command[1:])
    assert plan.decision.trainer.run["wandb_name"] == HOSTILE


def test_scaling_points_and_report_job_with_hostile_study_dir_run_nothing(tmp_path):
    """Issue 30, finding 9: `--study-dir '.../st$(touch X)u`touch Y`dy'` ran both commands."""
    env = _stubs(tmp_path)
    cluster, root = _slurm_profile(tmp_path)
    study_dir = root / "runs" / f"st{HOSTILE}dy"
    ns = scaling.build_parser().parse_args(
        ["--cluster", str(cluster), "--gpus", "1 2", "--study-dir", str(study_dir),
         "--args", _args(), "--steps", "4", "--warmup", "1"]
    )  # fmt: skip
    sweep = scaling.prepare(ns)
    scripts = scaling.materialize(sweep)
    assert [s.parent.parent for s in scripts] == [study_dir, study_dir]
    point, plan = sweep.points[1], sweep.plans[1]
    assert _run(scripts[1], env, **_slurm_job()) == 0
    train = [c for c in _calls(env) if c[0] == "srun" and plan.launch.argv[1] in c]
    assert len(train) == 1 and train[0][-len(plan.launch.argv) :] == list(plan.launch.argv)
    assert train[0][-1] == str(Path(point.run_dir) / runfiles.PLAN)
    assert point.decision.trainer.run["wandb_name"] == HOSTILE

    # the report job: the study path in its echo line and its srun argv; hostile job ids too
    for ids in (["40", "41"], ["40", f"41{HOSTILE}"]):
        Path(env["STUB_LOG"]).unlink()
        report = study_dir / f"report-{len(ids[1])}.sbatch"
        report.write_text(reportjob.render_script(sweep.report_spec, study_dir, ids))
        assert _run(report, env, **_slurm_job()) == 0
        (call,) = _calls(env)
        assert call[0] == "srun" and call[-4:] == [
            sweep.report_spec.python, "-m", "vitpod.workflows.studies.reportjob", str(study_dir),
        ]  # fmt: skip


def test_partials_with_hostile_context_run_nothing(tmp_path):
    """The partials rendered on their own, with values a profile could not even hold (its name
    and paths are validated): the doctor's failure message, the environment and credentials."""
    env = _stubs(tmp_path)
    doctor = render("partials/doctor.sh.j2", {"argv": ["env", HOSTILE], "exit_code": 3,
                                              "cluster": HOSTILE})  # fmt: skip
    setup = render(
        "partials/env.sh.j2",
        {"env": {"VITPOD_HOSTILE": HOSTILE}, "secrets": ["VITPOD_SECRET"], "slurm": False,
         "enroot_credentials": {"dir": str(tmp_path / f"enroot{HOSTILE}"), "line": HOSTILE,
                                "password": "VITPOD_SECRET"}},
    )  # fmt: skip
    script = tmp_path / "partials.sh"
    script.write_text(f'{setup}\nprintf "%s" "$VITPOD_HOSTILE" >"$P.env"\n{doctor}')
    assert _run(script, env, **_slurm_job(), STUB_FAIL_DOCTOR="1") == 3
    (call,) = _calls(env)
    assert call[-2:] == ["env", HOSTILE]  # the doctor's srun got the argv verbatim
    assert Path(env["P"] + ".env").read_text() == HOSTILE
    assert (tmp_path / f"enroot{HOSTILE}" / ".credentials").read_text() == HOSTILE + "\n"


@pytest.mark.parametrize(
    ("template", "context", "field"),
    [
        (
            "report.sh.j2",
            {"study_dir": "/s\ntouch X", "job_ids": "1", "srun_args": [], "python": "python3"},
            "study_dir",
        ),  # fmt: skip
        (
            "partials/doctor.sh.j2",
            {"argv": ["env"], "exit_code": 3, "cluster": "a\rb"},
            "cluster",
        ),  # fmt: skip
        (
            "partials/env.sh.j2",
            {"env": {"A": "1\n2"}, "secrets": [], "slurm": False, "enroot_credentials": None},
            "value",
        ),  # fmt: skip
    ],
)
def test_a_newline_is_refused_naming_the_template_field(template, context, field):
    with pytest.raises(ValueError, match=rf"templates/{template}:\d+ {field}\b.*newline"):
        render(template, context)


def test_a_newline_in_an_sbatch_value_is_refused_naming_the_field(tmp_path):
    cluster, root = _slurm_profile(tmp_path)
    plan = plan_job(Request(cluster=str(cluster), model="", stage="pretrain", nodes=1,
                            run_dir=root / "runs" / "run"))  # fmt: skip
    spec = dataclasses.replace(plan.spec, log_dir=f"{root}/a\nb")
    with pytest.raises(ValueError, match=r"header.sh.j2:\d+ spec.log_dir\b.*#SBATCH line"):
        render("partials/header.sh.j2", {"spec": spec})
    # the planner refuses such a run path before any template (ConfigError naming the field)
    with pytest.raises(ValueError, match=r"run root .*cannot contain .* newlines"):
        plan_job(Request(cluster=str(cluster), model="", stage="pretrain", nodes=1,
                         run_dir=root / "runs" / "a\nb"))  # fmt: skip


def test_stub_log_catches_an_unquoted_value(tmp_path):
    """The harness can fail: the same payload, rendered without `q`, creates the marker."""
    env = _stubs(tmp_path)
    script = tmp_path / "loose.sh"
    script.write_text(f'echo "report of {HOSTILE}"\n')
    with pytest.raises(AssertionError, match="a payload ran"):
        _run(script, env)
    assert os.path.exists(env["P"])
