"""A stage's frozen JobSpec (resources, command) and the one Launch (srun, env, binding)."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vitpod.registry import runfiles
from vitpod.registry.trainconfig import TrainConfig
from vitpod.trainer.exitcodes import REQUEUE, killed_by_statuses
from vitpod.workflows.containers import container, registryref
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.masterport import master_port_expr, master_port_span_lines
from vitpod.workflows.planning.recipe import Recipe
from vitpod.workflows.planning.trainerargv import extra_args, trainer_flags
from vitpod.workflows.site import doctor_step
from vitpod.workflows.site.profile import NodeType, Profile, resolve_path
from vitpod.workflows.site.rankthreads import rank_threads
from vitpod.workflows.templating import render

Entry = Literal["trainer", "rankinfo", "commbench", "labels"]
COMMBENCH_OUT = "commbench.json"  # what the commbench entry writes in its run directory
# srun --wait: once one rank exits, the others get this long, then are killed. Not
# --kill-on-bad-exit=1: srun would end the other ranks with SIGTERM, which they (and bind.sh)
# take for a preemption, so a killed rank requeued the job instead of failing it (measured:
# test_resume_slurm's SIGKILLed rank ended COMPLETED). The others fail on their own at the next
# collective. A preempted rank leaves the requeue marker and bind.sh exits 0 (teardown: exit 75).
RANK_EXIT_WAIT_S = 60
ROCE_ENV = {"NCCL_IB_GID_INDEX": "3"}
"""Set on `fabric.network: roce` only (the profile's env may give another value): NCCL's GID
index 3 is RoCE v2 (IPv4) on a default Mellanox/NVIDIA configuration; InfiniBand needs no GID."""
# bind.sh exports the path of the rank's requeue marker under this name (for the submitit task).
REQUEUE_MARKER_ENV = "VITPOD_REQUEUE_MARKER"
_DEPENDENCY = re.compile(
    r"^(singleton|[a-z_]+(:[0-9A-Za-z_.+]+)+)([,?](singleton|[a-z_]+(:[0-9A-Za-z_.+]+)+))*$"
)


GENERATED_DATASETS = ("digits", "synthetic")
"""Data sets the trainer writes or makes up on first use (atomically), so none need exist."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything the templates need; nothing is computed in Jinja."""

    profile: Profile
    model: str
    stage: str
    job_name: str
    run_dir: str
    log_dir: str
    partition: str
    time: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    mem: str
    account: str | None
    qos: str | None
    signal: str
    requeue: bool
    exclusive: bool
    dependency: str | None
    python: str
    code_dir: str
    """Where ranks start when there is no container (the repository on shared storage)."""
    data_dir: str | None
    """The DATA_DIR that must exist before submission (None when ranks do not run the trainer,
    or when the trainer generates the data set itself: digits, synthetic)."""
    finetune_from: str | None
    """The model the finetune starts from (absolute path; may not exist yet in a pipeline)."""
    module: str
    """The entry's module (python -m MODULE): vitpod.trainer, vitpod.trainer.tokenlabels.label."""
    args: tuple[str, ...]
    """The entry's own argv, its parser's input (the trainer's: DATA_DIR --model M, the recipe's
    flags, then ARGS; the planner parses it once, and its ranks start from plan.json)."""
    extra_args: tuple[str, ...]
    entry: Entry = "trainer"
    workers: int = 0
    """Loader worker processes per rank (the trainer's --workers): bind.sh leaves each a CPU."""
    requeue_exit: int = REQUEUE
    nodes_max: int | None = None
    """A node range nodes..nodes_max (profile `nodes: MIN-MAX`): Slurm picks, the job adapts."""
    reservation: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    sbatch_extra: tuple[str, ...] = ()
    """More #SBATCH options, --name[=value] (SBATCH_EXTRA; workflows/planning/sbatchopts.py)."""
    sbatch_set_by: dict[str, str] = field(default_factory=dict)
    """The make variable that set each per-submission option (account: ACCOUNT); an option
    absent here is the profile's (account, qos) or not set."""

    @property
    def nodes_arg(self) -> str:
        """#SBATCH --nodes=: a count, or MIN-MAX."""
        return f"{self.nodes}-{self.nodes_max}" if self.nodes_max else str(self.nodes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def command(self) -> tuple[str, ...]:
        return (self.python, "-m", self.module, *self.args)

    @property
    def rank_command(self) -> tuple[str, ...]:
        """What each rank runs after the binding step: a trainer starts from the run's plan.json
        (`args` resolved by the planner); the other entries run `command`."""
        if self.entry != "trainer":
            return self.command
        return (self.python, "-m", self.module, "--plan", str(Path(self.run_dir) / runfiles.PLAN))

    @property
    def bind_path(self) -> str:
        return str(Path(self.run_dir) / "bind.sh")

    @property
    def requeue_marker(self) -> str:
        """Shell word for the file a rank leaves when its command exits `requeue_exit`.

        bind.sh writes it, the batch script's teardown reads it; it expands to one name per job
        id and restart, in the run's logs/ (shared storage, visible to the batch script).
        """
        name = '"requeue-${SLURM_JOB_ID}-restart${SLURM_RESTART_COUNT:-0}"'
        return f"{shlex.quote(self.log_dir)}/{name}"


@dataclass(frozen=True)
class Launch:
    """How each rank is started: what the sbatch template renders (every submission sbatches
    that rendered script, workflows/submit/submission.py).

    `srun_args` are complete single arguments (the template quotes them); `setup_lines`
    are shell lines run once in the batch script before srun (environment, MASTER_ADDR/PORT);
    `teardown_lines` run right after srun (they start with `rc=$?`): the one requeue rule, then
    `exit "$rc"`. `bind_script` is the text of RUN_DIR/bind.sh, which every rank runs as `bash
    bind.sh <command...>`: it picks NUMA node, CPUs and HCA by SLURM_LOCALID, prints what it bound,
    sets RANK/LOCAL_RANK/WORLD_SIZE, runs the command and leaves the requeue marker when the command
    exits 75.
    """

    srun_args: tuple[str, ...]
    env: dict[str, str]
    setup_lines: tuple[str, ...]
    teardown_lines: tuple[str, ...]
    bind_script: str
    bind_path: str
    python: str
    argv: tuple[str, ...]
    """What srun runs on every task: bash bind.sh <python> <args...>."""
    container_env: tuple[str, ...] = field(default=())

    @property
    def launcher(self) -> tuple[str, ...]:
        """Command prefix of every rank: the binding step, then the job's python."""
        return ("bash", self.bind_path, self.python)

    def write_bind_script(self) -> Path:
        """Write bind.sh atomically (mode 0750), creating its run directory if needed."""
        from vitpod.workflows.jobs.rundir import DIR_MODE, write_atomic

        path = Path(self.bind_path)
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        write_atomic(path, self.bind_script, mode=0o750)
        return path


def build_spec(
    profile: Profile,
    recipe: Recipe,
    stage: str,
    *,
    run_dir: Path,
    nodes: int,
    args: str = "",
    finetune_from: str | None = None,
    dependency: str | None = None,
    entry: Entry = "trainer",
    nodes_max: int | None = None,
) -> JobSpec:
    """One stage's job on its partition's nodes; raises ConfigError naming the field.

    Nothing here looks at the file system: whether paths exist is the preflight's business, so
    a script for any cluster can be rendered anywhere.
    """
    stage_recipe = recipe.stage(stage)
    extra = extra_args(args)
    partition = profile.partition(stage)
    node = profile.node_type(stage)
    _check_dependency(dependency)
    finetune = _finetune_source(stage, stage_recipe.finetune, entry, finetune_from)
    python = _python(profile)
    data_dir: str | None = None
    data_path = str(resolve_path(profile.storage.data) / (stage_recipe.data or ""))
    argv: tuple[str, ...] = ()
    if entry == "rankinfo":
        module = "vitpod.node.rankinfo"
    elif entry == "commbench":  # collective timings for `make calibrate`; ARGS go to it
        module = "vitpod.trainer.engines.commbench"
        argv = ("--out", str(run_dir / COMMBENCH_OUT), *extra)
    elif entry == "labels":  # token labels for this stage's data (workflows/pipeline/labels.py)
        generated = stage_recipe.dataset in GENERATED_DATASETS
        dataset = ["--dataset", stage_recipe.dataset] if generated else []
        module, argv = "vitpod.trainer.tokenlabels.label", (data_path, *dataset, *extra)
        data_dir = None if generated else data_path
    else:
        flags = trainer_flags(profile, stage_recipe, run_dir, finetune, extra)
        module, argv = "vitpod.trainer", (data_path, "--model", recipe.model, *flags)
        if stage_recipe.dataset not in GENERATED_DATASETS:
            data_dir = data_path
    return JobSpec(
        profile=profile,
        model=recipe.model,
        stage=stage,
        job_name=f"vitpod-{recipe.model}-{'labels' if entry == 'labels' else stage}",
        run_dir=str(run_dir),
        log_dir=str(run_dir / runfiles.LOGS),
        partition=partition.name,
        time=partition.time,
        nodes=nodes,
        nodes_max=nodes_max,
        tasks_per_node=node.ranks_per_node,
        gpus_per_node=node.gpus_per_node,
        cpus_per_task=node.cpus_per_task,
        mem=node.mem,
        account=profile.account,
        qos=profile.qos,
        signal=f"{profile.preemption.signal}@{profile.preemption.grace_s}",
        requeue=profile.preemption.requeue,
        exclusive=profile.exclusive,
        dependency=dependency,
        python=python,
        code_dir=str(resolve_path(profile.storage.code)),
        data_dir=data_dir,
        finetune_from=finetune,
        module=module,
        args=tuple(argv),
        extra_args=tuple(extra),
        entry=entry,
        # the trainer's default; plan_job sets the parsed --workers (the labeler runs none)
        workers=TrainConfig.workers if entry == "trainer" else 0,
    )


def _check_dependency(dependency: str | None) -> None:
    if dependency and not _DEPENDENCY.match(dependency):
        raise ConfigError(
            f"dependency={dependency!r} is not a Slurm dependency; write e.g. afterok:1234 or "
            "afterok:1234:1235,afterany:99"
        )


def _finetune_source(
    stage: str, finetunes: bool, entry: str, finetune_from: str | None
) -> str | None:
    """The stage's fine-tune source (absolute); a stage that starts from scratch refuses one
    (it would be ignored). Whether it exists: plan_job (preflight.finetune_source_problem)."""
    if finetune_from and not finetunes:
        raise ConfigError(
            f"FINETUNE_FROM={finetune_from!r}: the {stage} stage starts from scratch and would "
            "ignore it; drop FINETUNE_FROM, or fine-tune with STAGE=finetune (make finetune)"
        )
    if entry == "labels":
        return None
    if not finetune_from:
        if finetunes:
            raise ConfigError(
                "FINETUNE_FROM: the finetune stage needs the pretrain run directory (or a "
                "checkpoint); e.g. make finetune FINETUNE_FROM=runs/<pretrain run>"
            )
        return None
    return str(Path(finetune_from).expanduser().absolute())


def _python(profile: Profile) -> str:
    if profile.container is not None:
        python = profile.container.python  # a relative path is relative to the repository
        return python if "/" not in python else container.host_path(python, resolve=False)
    return profile.python or sys.executable


def environment(spec: JobSpec) -> dict[str, str]:
    """Variables exported before srun: the profile's env, plus RoCE's on a RoCE fabric.

    OMP_NUM_THREADS is not one value for the job: bind.sh sets it per rank (`rank_threads`),
    unless the profile's env gives it."""
    env = {"VITPOD_BACKEND": spec.profile.backend, **spec.profile.env}
    if spec.profile.node_type(spec.stage).network == "roce":
        for name, value in ROCE_ENV.items():
            env.setdefault(name, value)
    return env


def _container_args(spec: JobSpec, env_names: list[str]) -> list[str]:
    if spec.profile.container is None:
        return []
    # The run's directory tree (its siblings: a pipeline's other stage) and a fine-tune source
    # are mounted at the same paths when no profile mount covers them.
    root = "run root (--run-root, VITPOD_RUN_ROOT or storage.runs)"
    extra = [(root, str(Path(spec.run_dir).parent))]
    finetune = spec.finetune_from if spec.entry == "trainer" else None
    extra += [("--finetune (FINETUNE_FROM)", finetune)] if finetune else []
    return container.srun_args(spec.profile.container, env_names, extra)


def _container_start_lines(spec: JobSpec, srun_args: list[str]) -> list[str]:
    """container.start_once: one step per node creates the job's named container (cold, then
    warm start measured); the lines export PYXIS_CONTAINER_NAME for the ranks' step."""
    container = spec.profile.container
    if container is None or not container.start_once or spec.profile.scheduler != "slurm":
        return []
    context = {"spec": spec, "srun_args": srun_args,
               "container_start_file": runfiles.CONTAINER_START}  # fmt: skip
    return render("partials/container_start.sh.j2", context).strip("\n").splitlines()


def launch_for(spec: JobSpec) -> Launch:
    """The single source of srun flags, environment and per-rank binding for one job."""
    profile = spec.profile
    env = environment(spec)
    env_names = sorted({*env, "MASTER_ADDR", "MASTER_PORT", *profile.secrets})
    srun_args = [f"--mpi={profile.mpi}"] if profile.mpi else []  # the trainer needs no MPI
    srun_args += ["--kill-on-bad-exit=0", f"--wait={RANK_EXIT_WAIT_S}", "--cpu-bind=none"]
    if profile.container is None:  # ranks start in the code directory (in a container: workdir)
        srun_args.append(f"--chdir={spec.code_dir}")
    srun_args += _container_args(spec, env_names)
    context = {
        "env": env,
        "network": profile.node_type(spec.stage).network,
        "roce_env": sorted(ROCE_ENV),
        "secrets": profile.secrets,
        "slurm": profile.scheduler == "slurm",
        "master_port": master_port_expr(),
        "enroot_credentials": _enroot_credentials(spec),
        "master_port_span": master_port_span_lines(),
    }
    setup = render("partials/env.sh.j2", context).strip("\n").splitlines()
    setup += doctor_step.setup_lines(profile, spec.stage, spec.run_dir)
    setup += _container_start_lines(spec, srun_args)
    teardown = render("partials/teardown.sh.j2", {
        "spec": spec, "enroot_dir": runfiles.ENROOT_CONFIG,
        "checkpoints": str(Path(spec.run_dir) / runfiles.CHECKPOINTS),
        "commit": runfiles.CHECKPOINT_COMMIT,
        "progress_file": str(Path(spec.run_dir) / runfiles.REQUEUE_PROGRESS),
    })  # fmt: skip
    teardown_lines = teardown.strip("\n").splitlines()
    node = profile.node_type(spec.stage)
    workers = spec.workers
    threads = rank_threads(node, workers)
    bind = render(
        "bind.sh.j2",
        {
            "spec": spec,
            "bindings": _bindings(node, threads),
            "marker_env": REQUEUE_MARKER_ENV,
            "killed_by": killed_by_statuses(),
            "omp_from_profile": "OMP_NUM_THREADS" in env,
            "threads": threads[0] if not node.binding else "",
            "workers": workers,
        },
    )
    return Launch(
        srun_args=tuple(srun_args),
        env=env,
        setup_lines=tuple(setup),
        teardown_lines=tuple(teardown_lines),
        bind_script=bind,
        bind_path=spec.bind_path,
        python=spec.python,
        argv=("bash", spec.bind_path, *spec.rank_command),
        container_env=tuple(env_names),
    )


def _enroot_credentials(spec: JobSpec) -> dict[str, str] | None:
    """The job's enroot credentials file: where, and its one line (the password by NAME)."""
    c = spec.profile.container
    ref = registryref.parse(c.image) if c is not None and c.credentials is not None else None
    if c is None or c.credentials is None or ref is None:
        return None
    return {
        "dir": str(Path(spec.run_dir) / runfiles.ENROOT_CONFIG),
        "line": registryref.credentials_line(ref, c.credentials.password),
        "password": c.credentials.password,
    }


def _bindings(node: NodeType, threads: dict[int, int]) -> list[dict[str, Any]]:
    return [
        {"local_rank": b.local_rank, "numa": b.numa, "cpus": b.cpus or "", "hca": b.hca or "",
         "threads": threads[b.local_rank]}
        for b in sorted(node.binding, key=lambda b: b.local_rank)
    ]  # fmt: skip
