"""The trainer argv the planner parses once: the recipe's flags, a config file given in ARGS,
shared-storage paths, the run directory, then ARGS (last wins), with the flags vitpod sets itself
refused in ARGS. The ranks never run it: they start from plan.json (--plan)."""

from __future__ import annotations

import shlex
from pathlib import Path

from vitpod.trainer.config import ConfigError as TrainerConfigError
from vitpod.trainer.settings.flags import layered_argv
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.recipe import StageRecipe
from vitpod.workflows.site.profile import Profile, resolve_path

# Flags vitpod sets itself; giving them in ARGS would silently fight the run layout.
RESERVED = {
    "--output": "the run directory is created by vitpod",
    "--finetune": "use FINETUNE_FROM=",
    "--data-dir": "the data path is the profile's storage.data",
    "--experiment": "vitpod names the run directory (<runs>/<time>-<model>-<stage>-<id>)",
    "--plan": "the ranks start from the run's own plan.json, which vitpod writes",
    # Every (re)start runs `--resume auto`; a --resume in ARGS would come after it and win on
    # every requeue (each restart back at the same checkpoint, or at step 0 with `none`).
    "--resume": "every start and requeue resumes the run's newest complete checkpoint; to "
    "continue a stopped run use `make resume RUN=<run dir>`, to start from a checkpoint's "
    "weights use FINETUNE_FROM=<checkpoint or run dir>",
}


# Keys vitpod sets for every run (RESERVED, and the profile's data path); a config file's values
# for them are not used by a planned job.
OWNED = ("data_dir", "output", "resume", "finetune", "experiment")


def trainer_flags(
    profile: Profile, stage: StageRecipe, run_dir: Path, finetune: str | None, extra: list[str]
) -> list[str]:
    """The recipe's flags, a config file in ARGS (-c FILE, inlined), the fine-tune source and
    run directory, then ARGS: the trainer's one precedence
    (vitpod.trainer.settings.flags.layered_argv)."""
    recipe = stage.trainer_flags()
    if stage.token_label and stage.token_label_data:
        labels = resolve_path(profile.storage.data) / stage.token_label_data
        recipe += ["--token-label-data", str(labels)]
    fixed = ["--finetune", finetune] if finetune else []
    fixed += ["--output", str(run_dir), "--resume", "auto"]
    try:
        return layered_argv(extra, base=recipe, fixed=fixed, owned=OWNED)
    except TrainerConfigError as exc:
        raise ConfigError(f"ARGS: {exc}") from None


def extra_args(args: str) -> list[str]:
    try:
        extra = shlex.split(args or "")
    except ValueError as exc:
        raise ConfigError(f"ARGS={args!r}: {exc}; balance the quotes") from None
    for arg in extra:
        if any(c in arg for c in "\n\r\0"):  # no flag takes one; a log line cannot carry it
            raise ConfigError(
                f"ARGS: {arg!r} contains a newline, carriage return or NUL; remove it"
            )
        flag = arg.split("=", 1)[0]
        if flag in RESERVED:
            raise ConfigError(f"ARGS: {flag} is set by vitpod ({RESERVED[flag]}); remove it")
    return extra
