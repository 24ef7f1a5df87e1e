"""Why a stage failed or is stuck, named from its rank logs and Slurm state, with the fix."""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from vitpod.registry import runfiles
from vitpod.workflows.watching.rootcause import attempt_logs, root_cause

# A running stage is stuck after this many median step times without a new step.
HANG_FACTOR = float(os.environ.get("VITPOD_HANG_FACTOR") or 10)
_MAX_LINES = 3  # root-cause lines shown per diagnosis


@dataclass(frozen=True)
class Rule:
    """A cause: matched by a log line (`pattern`), a Slurm state or an exit status."""

    cause: str
    fix: str
    pattern: re.Pattern[str] | None = None
    states: frozenset[str] = frozenset()
    exit_code: int | None = None


@dataclass(frozen=True)
class Diagnosis:
    """What `make status` and the follow view print under a failed or stuck stage."""

    cause: str
    fix: str
    lines: tuple[str, ...]

    def text(self) -> list[str]:
        return [f"cause: {self.cause}", *("    " + x for x in self.lines), f"fix: {self.fix}"]


def _re(text: str) -> re.Pattern[str]:
    return re.compile(text, re.IGNORECASE)


# First match wins: hardware and resource causes before the collective errors they provoke.
RULES: tuple[Rule, ...] = (
    Rule("GPU memory error (ECC)",
         "drain the node (scontrol update nodename=NODE state=drain reason=ECC), resubmit with "
         "--exclude=NODE; checkpoints make the resubmission resume",
         _re(r"uncorrectable ECC error|ECC error encountered|"
             r"NVRM: Xid \([^)]*\): (48|63|64|94|95)\b")),
    Rule("GPU fault (Xid)",
         "look the Xid number up in NVIDIA's Xid catalog; 79 (fell off the bus) and 119/120 (GSP) "
         "need the node drained and reset by an admin; resubmit with --exclude=NODE",
         _re(r"NVRM: Xid \(")),
    Rule("out of GPU memory",
         "lower --batch-size (keep the global batch with --accum-steps), or use --fsdp / "
         "activation checkpointing; `vitpod memory` estimates the peak before submitting",
         _re(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")),
    Rule("out of host memory",
         "fewer data workers (--workers), or more memory per node "
         "(the profile's `mem:`); the OOM killer's victim has no traceback",
         _re(r"\bMemoryError\b|oom[-_ ]kill|Out of memory: Killed process|Cannot allocate memory|"
             r"can't allocate memory|std::bad_alloc"),
         frozenset({"OUT_OF_MEMORY"})),
    Rule("registry credentials refused",
         "put the registry's login in ~/.config/enroot/.credentials (netrc: machine HOST login "
         "USER password TOKEN) on the nodes, or name them in the profile's container.credentials; "
         "check the image name",
         _re(r"401 Unauthorized|\bunauthorized\b|Could not process JSON input")),
    Rule("container import or mount failed (pyxis/enroot)",
         "check the image exists and every --container-mounts source exists on the nodes "
         "(profile `storage:`); `enroot import` the image by hand on a node to see its error",
         _re(r"pyxis: .*(fail|error|couldn.t|does not exist)|\[ERROR\].*enroot|"
             r"enroot-\w+: .*(fail|error)|"
             r"pyxis: container start failed")),
    Rule("NCCL timeout (collective watchdog)",
         "one rank stopped reaching the collective: look for the first failing rank above "
         "(a hang, an OOM, a bad node); NCCL_DEBUG=INFO shows the ring; raise the timeout only "
         "for a known slow step",
         _re(r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*[Tt]imeout|"
             r"NCCL.*timed? ?out")),
    Rule("time limit reached",
         "raise the partition's `time:` in the profile (or TIME=), or checkpoint more often "
         "(--checkpoint-every) so a resubmission resumes",
         _re(r"DUE TO TIME LIMIT"), frozenset({"TIMEOUT"})),
    Rule("node failure",
         "resubmit (the checkpoints resume it); exclude the node if it fails again",
         _re(r"DUE TO NODE FAIL"), frozenset({"NODE_FAIL"})),
    Rule("checkpoint storage error (EIO, ESTALE, EACCES, a timeout or short read at resume)",
         "no checkpoint was moved or deleted: check the filesystem holding the run (mount, "
         "permissions, quota, the file server), then make resume RUN=<run dir>",
         _re(r"checkpoint storage error")),
    Rule("requeue stopped: starts in a row were preempted without a new checkpoint",
         "lower the profile's preemption.grace_s or raise the partition's time so that a start "
         "reaches a checkpoint (or checkpoint more often, --checkpoint-every); then "
         "make resume RUN=<run dir> (preemption.max_requeues_without_progress sets the bound)",
         _re(r"vitpod: error: not requeueing job")),
    Rule("preempted (exit 75)",
         "nothing to fix: the job checkpointed and is requeued; without requeue resubmit the "
         "run's job.sbatch and it resumes from the newest checkpoint",
         _re(r"preempted \(SIG\w+\)"), exit_code=75),
    Rule("bad configuration (exit 2)",
         "fix the flag or path named in the error line and resubmit; `make preflight` catches "
         "most before submission",
         _re(r"^(\d+: |\[rank\d+\] )?error: "), exit_code=2),
    Rule("hang: a rank made no progress within its timeout (the watchdog)",
         "the line names the rank, node, step and section; its stacks are in logs/stacks-*.txt "
         "and the rank logs; a node named twice is excluded on requeue (RUN/exclude-nodes); "
         "tune the profile's hang: block (docs/hangs.md)",
         _re(r"^vitpod: hang: rank")),
    Rule("a rank was killed",
         "no traceback: it was stopped from outside (kill -9, the OOM killer, a node failure); "
         "sacct -j JOB -o JobID,State,ExitCode,MaxRSS and the node's dmesg tell which",
         _re(r"srun: error: \S+: tasks? [\d,-]+: (Killed|Exited with exit code 137)")),
)  # fmt: skip


def _matches(rule: Rule, files: list[Path]) -> list[str]:
    assert rule.pattern is not None
    found = []
    for path in files:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if rule.pattern.search(line):
                found.append(f"{path.name}:{lineno}: {line.strip()[:300]}")
                if len(found) >= _MAX_LINES:
                    return found
    return found


def diagnose(log_dir: Path, state: str = "", exit_code: str = "") -> Diagnosis | None:
    """The first rule of RULES that the newest attempt's logs, `state` or `exit_code` match."""
    files = attempt_logs(log_dir)
    status = _exit_status(exit_code)
    for rule in RULES:
        lines = _matches(rule, files) if rule.pattern is not None else []
        by_state = state in rule.states or (rule.exit_code is not None and status == rule.exit_code)
        if lines or by_state:
            if not lines:
                lines = [f"slurm: state {state} exit code {exit_code or '-'}"]
            return Diagnosis(rule.cause, rule.fix, tuple(lines))
    tb = root_cause(log_dir)
    if tb is not None:
        return Diagnosis("an error in the trainer", "see the traceback", (tb.exception,))
    return None


def _exit_status(exit_code: str) -> int | None:
    """sacct's ExitCode "2:0" (status:signal) -> 2."""
    head = exit_code.split(":")[0]
    return int(head) if head.isdigit() else None


def stuck(run_dir: Path, factor: float = HANG_FACTOR, now: float | None = None) -> Diagnosis | None:
    """A running stage whose ranks wrote no step for `factor` median step times (beyond the
    steps a --log-interval batch holds back), from its metrics files."""
    newest: dict[str, float] = {}
    stamps: list[float] = []
    for path in runfiles.metrics_files(run_dir):
        for record in runfiles.read_jsonl(path):
            if record["kind"] != "step" or "wall_time" not in record:
                continue
            stamp = float(record["wall_time"])
            newest[path.stem] = stamp
            if path.stem == "rank0":
                stamps.append(stamp)
    return stuck_since(newest, stamps[-21:], log_interval(run_dir), factor, now)


def stuck_since(
    newest: dict[str, float],
    stamps: list[float],
    log_interval: int,
    factor: float,
    now: float | None = None,
) -> Diagnosis | None:
    """`newest`: each rank's newest step end; `stamps`: rank 0's recent step ends."""
    spans = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
    if not spans or not newest:
        return None
    median = statistics.median(spans)
    quiet = (time.time() if now is None else now) - min(newest.values())
    if quiet <= (factor + log_interval) * median:
        return None
    rank = min(newest, key=lambda r: newest[r])
    return Diagnosis(
        f"stuck: no step for {quiet:.0f} s ({factor:g} x the median step time {median:.2f} s, "
        "after the steps a log interval holds back)",
        "find the stopped rank: `srun --overlap --jobid JOB py-spy dump --pid PID` on its node "
        "(or `top` for a process in state T/D); scancel the job and resubmit to resume from "
        "the newest checkpoint",
        (f"{rank}: newest step written {quiet:.0f} s ago",),
    )


def log_interval(run_dir: Path) -> int:
    try:
        return int(runfiles.read_record(run_dir / runfiles.CONFIG).get("log_interval", 50))
    except (OSError, ValueError, TypeError):
        return 50
