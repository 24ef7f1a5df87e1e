"""The one way vitpod asks Slurm: sbatch, squeue, sacct, scontrol, sinfo, sacctmgr, scancel and
srun all go through `call`, with one timeout per command (TIMEOUT_S), one parser per output format
(`oneliner` for scontrol's key=value lines, `parsable` for sacct/sacctmgr -P, squeue -O and sinfo
-o with '|' between fields) and one error, SlurmError, naming the command line, exit status and
stderr.

Several clusters under one slurmdbd (multi-cluster operation): inside `with on_cluster(NAME):`
every command that takes it gets `--clusters=NAME` (-M), so the same calls ask another cluster's
controller (https://slurm.schedmd.com/multi_cluster.html); outside, the default cluster answers
(SLURM_CONF's).

Watching jobs costs a fixed number of calls whatever their number: `squeue` and `sacct` take every
job id at once (--jobs=a,b,c is one RPC to the controller, one to slurmdbd); asking job by job
hits per-user RPC limits with thousands of array tasks (facebookincubator/submitit#1759).
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from vitpod.workflows.errors import ConfigError

TIMEOUT_S = {
    "squeue": 30,
    "sacct": 30,
    "scontrol": 30,
    "sinfo": 30,
    "sacctmgr": 30,
    "scancel": 30,
    "sbatch": 60,
    "srun": 300,
}
"""Seconds each command may take. Queries answer in well under a second on a healthy controller;
sbatch may wait for a busy controller; srun runs a short job (the site probe) to its end."""

MULTI_CLUSTER = ("sbatch", "squeue", "sacct", "scontrol", "sinfo", "scancel")
"""The commands that take --clusters (sacctmgr names the cluster in its filters instead; srun
runs inside an allocation of the cluster it is on)."""
_cluster: ContextVar[str] = ContextVar("vitpod_slurm_cluster", default="")

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class SlurmError(ConfigError):
    """A Slurm command could not run, did not answer or failed: what is asked is unknown."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, what: str):
        self.argv, self.returncode, self.stderr = list(argv), returncode, stderr
        super().__init__(f"`{shown(argv)}` {what}")


class SlurmUnanswered(SlurmError):
    """The command timed out: the controller may have acted on it anyway (sbatch: queued)."""


def shown(argv: Sequence[str], width: int = 80) -> str:
    """The command line for a message, a long argument (500 job ids) cut to its start."""
    return shlex.join(
        a if len(a) <= width else f"{a[: width // 2]}...({len(a)} chars)" for a in argv
    )


def _subprocess(
    argv: list[str], *, timeout: float, input: str | None, cwd: Path | None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input,
                          cwd=cwd, check=False)  # fmt: skip


runner: Runner = _subprocess
"""What runs a command; benchmarks/slurm_calls.py and the tests wrap it to count or fake calls."""


@contextmanager
def on_cluster(name: str | None) -> Iterator[None]:
    """Every Slurm command in the block asks cluster `name` (-M); None or '': the default."""
    token = _cluster.set(name or "")
    try:
        yield
    finally:
        _cluster.reset(token)


def current_cluster() -> str:
    """The cluster `on_cluster` chose for this block; '' for the default one."""
    return _cluster.get()


def cluster_name() -> str:
    """The cluster a block's commands ask: on_cluster's name, else the default controller's
    ClusterName ('' when it does not say)."""
    if name := current_cluster():
        return name
    for line in run(["scontrol", "show", "config"]).splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return value.strip()
    return ""


def call(
    argv: Sequence[str], *, input: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command, whatever its exit status; SlurmError when it cannot run,
    SlurmUnanswered when it outlives its TIMEOUT_S."""
    argv = list(argv)
    if (cluster := _cluster.get()) and argv[0] in MULTI_CLUSTER:
        argv.insert(1, f"--clusters={cluster}")
    timeout = TIMEOUT_S[argv[0]]
    try:
        return runner(argv, timeout=timeout, input=input, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise SlurmUnanswered(argv, None, "", f"did not answer within {timeout} s") from None
    except FileNotFoundError:
        raise SlurmError(argv, None, "", f"could not run ({argv[0]} is not on PATH: run this "
                                         "on a Slurm login node)") from None  # fmt: skip
    except OSError as exc:
        raise SlurmError(argv, None, "", f"could not run ({exc})") from None


def run(argv: Sequence[str], *, input: str | None = None, cwd: Path | None = None,
        nothing_if: str = "") -> str:  # fmt: skip
    """A Slurm command's stdout; SlurmError when it fails, except a failure whose message
    contains `nothing_if` (squeue's 'Invalid job id', scontrol's 'not found'), which is ''."""
    done = call(argv, input=input, cwd=cwd)
    if done.returncode == 0:
        return done.stdout
    said = done.stderr.strip() or done.stdout.strip()
    if nothing_if and nothing_if.lower() in said.lower():
        return ""
    last = said.splitlines()[-1] if said else "no message"
    raise SlurmError(argv, done.returncode, done.stderr, f"failed (exit {done.returncode}: {last})")


# --------------------------------------------------------------------------- output formats


def oneliner(text: str) -> list[dict[str, str]]:
    """`scontrol show ... --oneliner` -> one dict per line. Values may hold blanks (OS=Linux 6.1
    #1 SMP, Reason=ECC error [root@...]): a word without '=' belongs to the value before it."""
    out = []
    for line in text.splitlines():
        fields: dict[str, str] = {}
        last = ""
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep and key.replace("_", "").replace(":", "").isalnum():
                fields[key], last = value, key
            elif last:
                fields[last] += " " + word
        if fields:
            out.append(fields)
    return out


def parsable(text: str, fields: Sequence[str], strip: bool = False) -> list[dict[str, str]]:
    """'|'-separated lines (sacct/sacctmgr -P, squeue -O 'F:|', sinfo -o '%a|%b') -> one dict per
    line keyed by `fields`; a missing trailing field is ''. `strip`: squeue pads its columns."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("CLUSTER: "):  # -M's header before each cluster
            continue
        values = [v.strip() for v in line.split("|")] if strip else line.split("|")
        values = (values + [""] * len(fields))[: len(fields)]
        rows.append(dict(zip(fields, values, strict=True)))
    return rows


# --------------------------------------------------------------------------- commands


def squeue(job_ids: Sequence[str], fields: Sequence[str]) -> list[dict[str, str]]:
    """ONE squeue for all the jobs, finished ones the controller still holds included; [] when
    it knows none of them (squeue then fails with 'Invalid job id')."""
    argv = ["squeue", "-h", "--states=all", "-j", ",".join(job_ids),
            "-O", ",".join(f"{f}:|" for f in fields)]  # fmt: skip
    return parsable(run(argv, nothing_if="invalid job id"), fields, strip=True)


def sacct(job_ids: Sequence[str], fields: Sequence[str], *flags: str) -> list[dict[str, str]]:
    """ONE `sacct -n -P -X` (allocations only, --parsable2) for all the jobs; `flags`: more
    options (-D: every start of a requeued job)."""
    argv = ["sacct", "-n", "-P", "-X", *flags, "-j", ",".join(job_ids), "-o", ",".join(fields)]
    return parsable(run(argv), fields)


def scontrol_show(kind: str, name: str = "") -> list[dict[str, str]]:
    """`scontrol show KIND [NAME] --oneliner` records; [] when NAME is not found."""
    argv = ["scontrol", "show", kind, *([name] if name else []), "--oneliner"]
    return oneliner(run(argv, nothing_if="not found"))


def sinfo(fields: dict[str, str], *flags: str) -> list[dict[str, str]]:
    """`sinfo -h [FLAGS] -o '%x|%y'`, `fields`: name -> sinfo format letter ('node': '%N')."""
    argv = ["sinfo", "-h", *flags, "-o", "|".join(fields.values())]
    return parsable(run(argv), list(fields))


def sacctmgr_assoc(user: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """The user's associations (`sacctmgr -nP show assoc`)."""
    argv = ["sacctmgr", "-nP", "show", "assoc", f"user={user}", f"format={','.join(fields)}"]
    return parsable(run(argv), fields)


def sbatch(script: Path, extra: Sequence[str] = ()) -> str:
    """`sbatch --parsable [EXTRA] SCRIPT` from the script's directory; the job id.
    SlurmUnanswered on a timeout (the job may be queued), SlurmError when it is refused."""
    out = run(["sbatch", "--parsable", *extra, str(script)], cwd=script.parent)
    return out.strip().split(";")[0]


def scancel(job_ids: Sequence[str]) -> None:
    """ONE scancel for all the jobs (an array id cancels its tasks)."""
    if job_ids:
        run(["scancel", *job_ids])
