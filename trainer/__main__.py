"""`vitpod-train DATA_DIR [flags]` or `vitpod-train --plan RUN/plan.json` (the planner's ranks):
validate, train this rank, exit with a launcher status."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator

from vitpod.trainer.checkpointing.preempt import Preemption
from vitpod.trainer.exitcodes import OK, USAGE


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )


def usage_error(messages: list[str]) -> int:
    for message in messages:
        print(f"error: {message}", file=sys.stderr)
    return USAGE


def _count_classes_if_readable(cfg) -> None:
    """--print-config shows the class count training would use; null when the data is absent
    (printing must work away from the data, e.g. for the published commands' /path/to/...)."""
    from vitpod.trainer.data import DataConfigError, DataSourceError
    from vitpod.trainer.model.components import resolve_num_classes

    try:
        resolve_num_classes(cfg)
    except (DataConfigError, DataSourceError, OSError):
        pass


@contextlib.contextmanager
def collector_paused_for_startup() -> Iterator[Callable[[], None]]:
    """Import torch, timm and torchvision and build the trainer with the cyclic GC off; the
    caller calls the yielded `started()` once built, which freezes what exists and turns the GC
    back on. Those imports make about 430k objects that live until exit, and every collection
    on the way re-scanned them: a quarter of a rank's start-up CPU (7.6 -> 6.0 s on the 2-core
    machine). Frozen, no later collection scans them, and forked loader workers do not copy
    their pages (https://docs.python.org/3/library/gc.html#gc.freeze). On leaving, an
    in-process caller (a test) gets its collector back as it was."""
    gc.disable()

    def started() -> None:
        gc.freeze()
        gc.enable()

    try:
        yield started
    finally:
        gc.enable()
        gc.unfreeze()


@contextlib.contextmanager
def wandb_kept_out_unless_asked(log_wandb: bool) -> Iterator[None]:
    """timm imports wandb whenever it is installed (timm/utils/summary.py: `try: import wandb`);
    a run without --log-wandb then pays ~1 s of CPU a rank for it. A None entry in sys.modules
    makes that import raise ImportError, which timm expects (the import system's documented
    rule: https://docs.python.org/3/reference/import.html#the-module-cache). On leaving, an
    in-process caller (a test) can import wandb again."""
    blocked = not log_wandb and "wandb" not in sys.modules
    if blocked:
        sys.modules["wandb"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if blocked and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


def main(argv: list[str] | None = None) -> int:
    preemption = Preemption()
    preemption.install()  # first: a SIGUSR2/SIGTERM from here on sets a flag instead of killing
    from vitpod.registry.io import private_umask
    from vitpod.registry.trainsections import TrainerSettings
    from vitpod.trainer import dist as tdist
    from vitpod.trainer.config import ConfigError
    from vitpod.trainer.settings.checks import problems
    from vitpod.trainer.settings.flags import configure

    private_umask()  # torch, DCP and DeepSpeed create files with the umask: 0640, dirs 0750

    env = tdist.detect()
    try:
        cfg, decision = configure(argv, world_size=env.world_size)
    except ConfigError as exc:
        return usage_error([str(exc)])
    if cfg.print_config:
        _count_classes_if_readable(cfg)
        print(cfg.to_json())
        for message in problems(cfg, for_training=False):
            print(f"warning: training would refuse this: {message}", file=sys.stderr)
        return OK
    found = problems(cfg)
    if found:
        return usage_error(found)
    setup_logging(env.rank)
    log = logging.getLogger("vitpod.trainer")
    if decision is not None:  # the record's engine and precision lines for the log
        log.info("plan %s: %s", cfg.plan, decision.log_line())
        if decision.precision is not None:
            log.info("plan %s", decision.precision.line())
    for line in TrainerSettings.of(cfg).lines():
        log.info("configuration %s", line)
    with wandb_kept_out_unless_asked(cfg.log_wandb), collector_paused_for_startup() as started:
        from vitpod.trainer.checkpointing.checkpoint import ResumeError
        from vitpod.trainer.model.components import startup_errors
        from vitpod.trainer.train import Trainer

        try:
            trainer = Trainer(cfg, env, preemption)
        except startup_errors() as exc:
            tdist.teardown_quietly()
            return usage_error([str(exc)])
        started()
        try:
            code = trainer.run()
        except ResumeError as exc:  # every rank raises it, before any step: a configuration error
            trainer.close()
            return usage_error([str(exc)])
        # Any other error is raised without close(): its barrier would fail too when a peer is
        # gone (a rank killed, a full disk on one rank) and bury the cause under a gloo/NCCL
        # traceback. Exiting closes this rank's sockets, so its peers fail at once instead of
        # waiting.
        trainer.close()
        return code


GENERATED_SOURCE = "__autograph_generated_file"
"""DALI's conditionals (autograph) load each function they convert from a temporary file of this
name and delete it from an atexit hook (nvidia/dali/_autograph/pyct/loader.py, delete_on_exit),
which os._exit skips."""


def remove_generated_sources() -> None:
    """Delete the temporary sources this process's DALI pipelines were converted into: a rank
    leaves by os._exit, and every DALI run with RandAugment left dozens of them in the node's
    /tmp."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.startswith(GENERATED_SOURCE) and path:
            with contextlib.suppress(OSError):
                os.remove(path)


def exit_without_teardown(code: int) -> None:
    """Leave once everything is flushed: the interpreter's teardown after torch and timm were
    imported took 1.5 s on the 2-core machine (no Python frame runs in it; only libraries
    unload). main() has closed the checkpoints, metrics, loaders and process group by now."""
    remove_generated_sources()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli() -> None:
    """The `vitpod-train` console script.

    An error escaping main() is printed and the process leaves at once (exit 1, as Python's
    own). Left to the interpreter, its shutdown would join rank 0's checkpoint writer, which may
    be waiting for a dead peer's files to commit the step (up to commit_timeout_s): the rank
    would stay up until srun's --wait killed it, and the job's end would come a minute late.
    The step stays uncommitted; the checkpoints before it are complete and untouched."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - everything, KeyboardInterrupt included, ends the rank
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


if __name__ == "__main__":
    cli()
