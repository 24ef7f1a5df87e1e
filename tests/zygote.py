"""Local trainer ranks forked from one interpreter that has imported the trainer already.

A fresh `python -m vitpod.trainer` spends about 10 s of CPU importing torch, timm and
torchvision on the 2-core machine, and every rank of every local launch paid it: 4 ranks cost
about 20 s of wall time before their first line of trainer code. The zygote (one per pytest
process, so one per xdist worker, started on first use) imports the trainer once, while
single-threaded, and forks one child per rank. The child takes the rank's environment, working
directory and log file, runs the same entry point (`runpy` on vitpod.trainer, as `-m` does)
and exits as an interpreter would: threads joined and atexit run after an uncaught exception,
the trainer's own os._exit otherwise. What a fork cannot give is a rank that starts from
nothing: a test of what happens during the imports launches with `start_ranks(...,
fresh=True)`; VITPOD_TEST_FRESH_RANKS=1 does so for every launch.

Protocol: one JSON request a line on the zygote's stdin ({argv: the trainer's arguments, env,
cwd, log}); it answers
`started PID`, and `exited PID CODE` (CODE as Popen's returncode: -N for signal N) per child.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = "vitpod.trainer.train"
# Read by libraries when they load (libgomp at import torch, Python at startup): the zygote's
# must be what every rank is given (start_ranks in tests/helpers.py).
LOAD_TIME_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run_child(request: dict) -> None:
    """In the forked child: become the rank, run the trainer's entry point, never return."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from TMPDIR, as a new interpreter does
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = ["-m", *request["argv"]]
        import runpy

        try:
            runpy.run_module("vitpod.trainer", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does first
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def serve() -> None:
    """The zygote's loop: fork a child per request line, report each child's end."""
    from vitpod.trainer.__main__ import wandb_kept_out_unless_asked

    with wandb_kept_out_unless_asked(False):  # as a new rank imports them: wandb left out
        __import__(PRELOAD)
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, (
        "the zygote must be single-threaded to fork safely"
    )
    out = os.fdopen(os.dup(1), "w", buffering=1)
    pending = b""
    live: set[int] = set()
    stdin_open = True
    while stdin_open or live:
        ready, _, _ = select.select([0] if stdin_open else [], [], [], 0.05)
        if ready:
            chunk = os.read(0, 65536)
            stdin_open = bool(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in filter(None, lines):
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    out.close()
                    _run_child(request)
                live.add(pid)
                out.write(f"started {pid}\n")
        if not stdin_open:  # pytest has gone: its ranks go too
            for pid in live:
                os.kill(pid, signal.SIGKILL)
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            live.discard(pid)
            out.write(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n")


class ForkedRank:
    """The part of subprocess.Popen the trainer tests use, for a rank forked by the zygote."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.args = ["zygote", str(pid)]

    @property
    def returncode(self) -> int | None:
        return self.zygote.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.ended:
            if not self.zygote.ended.wait_for(lambda: self.pid in self.zygote.codes, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.zygote.codes[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client: starts the zygote process, asks it for ranks, records their ends."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1, env={**os.environ, **LOAD_TIME_ENV},
        )  # fmt: skip
        self.codes: dict[int, int] = {}
        self.ended = threading.Condition()
        self.started: queue.Queue[int] = queue.Queue()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, pid, *code = line.split()
            if kind == "started":
                with self.ended:  # a pid reused after a wrap: not the earlier rank's end
                    self.codes.pop(int(pid), None)
                self.started.put(int(pid))
            else:
                with self.ended:
                    self.codes[int(pid)] = int(code[0])
                    self.ended.notify_all()
        self.started.put(-1)  # the zygote died: no rank will start

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedRank:
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}
        with self.lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self.started.get(timeout=300)
        assert pid > 0, f"the test zygote exited ({self.proc.poll()}); see pytest's stderr"
        return ForkedRank(self, pid)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


_zygote: Zygote | None = None


def zygote() -> Zygote:
    """The session's zygote, started on first use (imports take ~10 s once)."""
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = Zygote()
        atexit.register(_zygote.close)
    return _zygote


if __name__ == "__main__":
    serve()
