"""plan.json: written once by the planner, read back typed; ranks start from it and nothing else."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitpod.registry.decision import (
    RecordError,
    find_decision,
    read_decision,
    write_decision,
)
from vitpod.registry.trainsections import TrainerSettings
from vitpod.trainer.config import ConfigError
from vitpod.trainer.settings.flags import parse_args
from vitpod.workflows.errors import ConfigError as WorkflowError
from vitpod.workflows.planning.plan import Request, plan_job

REPO = Path(__file__).resolve().parents[1]


def planned(tmp_path: Path, args: str = "", nodes: int = 2):
    plan = plan_job(
        Request(cluster="localslurm", model="volo_tiny", nodes=nodes, args=args,
                run_root=str(tmp_path / "runs"))
    )  # fmt: skip
    plan.run_dir.mkdir(parents=True)
    write_decision(plan.run_dir, plan.decision)
    return plan


def test_the_record_reads_back_equal_and_typed(tmp_path):
    plan = planned(tmp_path)
    back = read_decision(plan.run_dir)
    assert back == plan.decision
    assert back.resources.world_size == plan.spec.world_size
    assert back.layout.dp * back.layout.tp * back.layout.pp == back.resources.world_size
    assert back.engine.name in ("ring", "ps") and back.costs is not None


def test_a_record_of_another_version_or_shape_names_the_file(tmp_path):
    plan = planned(tmp_path)
    path = plan.run_dir / "plan.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(RecordError, match=r"plan\.json: version 99"):
        read_decision(plan.run_dir)
    path.write_text(json.dumps({**data, "engine": {"name": "star"}}))
    with pytest.raises(RecordError, match=r"plan\.json: engine\.name"):
        read_decision(plan.run_dir)
    assert find_decision(tmp_path) is None  # a run started by hand has none


def plan_argv(plan, *flags: str) -> list[str]:
    """A rank's command line as the rendered job gives it, plus flags."""
    return [*plan.launch.argv[5:], *flags]


def edited(plan, section: str, **values) -> str:
    """plan.json with `values` changed in one of its sections on disk; its path."""
    path = plan.run_dir / "plan.json"
    data = json.loads(path.read_text())
    data[section].update(values)
    path.write_text(json.dumps(data))
    return str(path)


def test_the_rendered_ranks_start_from_the_plan_and_the_script_shows_it(tmp_path):
    plan = planned(tmp_path)
    assert plan.launch.argv[3:] == (
        "-m",
        "vitpod.trainer",
        "--plan",
        str(plan.run_dir / "plan.json"),
    )
    assert f"--plan {plan.run_dir / 'plan.json'}" in plan.script
    for section in ("data", "model", "precision", "optim", "parallel", "run"):
        assert f"echo '  {section}: {{" in plan.script
    assert "--model" not in plan.script.split("srun \\")[1]  # the flags live in the plan only


def test_the_trainer_builds_its_configuration_from_the_plan(tmp_path):
    plan = planned(tmp_path, args="--exchange ps --epochs 3")
    record = plan.decision
    assert record.engine.name == "ps" and record.trainer.parallel["exchange"] == "ps"
    servers = record.engine.ps_servers
    assert servers == plan.spec.world_size  # the colocated server the cost model priced
    cfg = parse_args(plan_argv(plan), world_size=plan.spec.world_size)
    assert (cfg.engine, cfg.ps_servers, cfg.epochs) == ("ps", servers, 3)
    assert TrainerSettings.of(cfg) == record.trainer  # the plan is what the rank runs
    assert cfg.output == str(plan.run_dir)


def test_the_exchange_keeps_its_former_name_in_flags_and_older_plans(tmp_path):
    """--topology (the flag's name before --exchange) still parses; a plan.json that stores
    parallel.topology still starts its ranks."""
    plan = planned(tmp_path, args="--topology ps --epochs 3")
    assert plan.decision.engine.name == "ps" and plan.decision.trainer.parallel["exchange"] == "ps"
    path = plan.run_dir / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    older = json.loads(plan.decision.model_dump_json())
    older["trainer"]["parallel"]["topology"] = older["trainer"]["parallel"].pop("exchange")
    path.write_text(json.dumps(older))
    cfg = parse_args(["--plan", str(path)], world_size=plan.spec.world_size)
    assert (cfg.exchange, cfg.engine) == ("ps", "ps")


def test_a_ranks_configuration_is_the_plans_trainer_section_and_its_precision(tmp_path):
    """The rank validates plan.json's trainer section as it is (no flags, no second resolve)
    and runs the decision's precision: edited on disk, the rank runs the edited dtype."""
    plan = planned(tmp_path, args="--amp --epochs 3")
    cfg = parse_args(plan_argv(plan), world_size=4)
    assert TrainerSettings.of(cfg) == plan.decision.trainer
    assert cfg.requested["epochs"] == 3  # args.yaml records the planned value
    precision = plan.decision.precision
    assert (precision.dtype, cfg.amp, cfg.amp_dtype) == ("bf16", True, "bf16")
    path = edited(plan, "precision", dtype="fp16", loss_scaling="dynamic")
    assert plan.decision.trainer.precision["amp_dtype"] == "bf16"  # the section is unchanged
    cfg = parse_args(["--plan", path], world_size=4)
    assert (cfg.amp, cfg.amp_dtype) == (True, "fp16")  # the decision's dtype, not the section's
    edited(plan, "precision", dtype="fp32", loss_scaling="none")
    assert not parse_args(["--plan", path], world_size=4).use_amp
    edited(plan, "precision", dtype="bf16", loss_scaling="dynamic")
    with pytest.raises(ConfigError, match=r"precision\.loss_scaling 'dynamic' with dtype bf16"):
        parse_args(["--plan", path], world_size=4)


def test_vitpods_overrides_are_fields_and_a_bad_one_is_refused_naming_it(tmp_path):
    """Request.overrides (a sweep point's, a resume's pinned batch) set TrainConfig fields over
    the recipe and ARGS: plan.json holds them, the command does not."""
    req = dict(cluster="localslurm", model="volo_tiny", nodes=1, run_root=str(tmp_path))
    plan = plan_job(Request(**req, args="-b 4 --log-interval 5",
                            overrides={"batch_size": 8, "max_steps": 3}))  # fmt: skip
    assert (plan.trainer["batch_size"], plan.trainer["max_steps"]) == (8, 3)
    assert plan.trainer["log_interval"] == 5 and "--max-steps" not in plan.spec.command
    with pytest.raises(WorkflowError, match=r"overrides: unknown key\(s\) 'batch' \(did you "
                       r"mean 'batch_size'\?\); valid keys: \[.*'max_steps'"):  # fmt: skip
        plan_job(Request(**req, overrides={"batch": 8}))
    with pytest.raises(WorkflowError, match=r"overrides: max_steps='many': .*valid integer"):
        plan_job(Request(**req, overrides={"max_steps": "many"}))


def test_a_rank_takes_the_layout_from_the_decision(tmp_path):
    plan = planned(tmp_path, args="--exchange ring")
    path = edited(plan, "layout", dp=2, tp=2, pp=1)  # the trainer section still says tp 1
    with pytest.raises(ConfigError, match=r"run engine 'mesh' but its engine is 'ring'"):
        parse_args(["--plan", path], world_size=4)


def test_a_rank_started_from_a_plan_takes_no_other_flag(tmp_path):
    plan = planned(tmp_path, args="--epochs 3")
    with pytest.raises(ConfigError, match=r"^--epochs, --seed with --plan .*plan\.json alone"):
        parse_args(plan_argv(plan, "--epochs", "5", "--seed=7"), world_size=4)
    cfg = parse_args(plan_argv(plan, "--print-config"), world_size=4)  # what to do, not what
    assert cfg.print_config and cfg.epochs == 3


def test_the_rank_applies_the_plans_elastic_rule_to_the_world_it_got(tmp_path):
    plan = planned(tmp_path, args="-b 8 --global-batch 64 --elastic")
    assert plan.decision.trainer.optim["accum_steps"] == 2  # 64 / (4 ranks x 8)
    planned_lr = plan.decision.trainer.optim["lr"]
    cfg = parse_args(plan_argv(plan), world_size=2)  # Slurm gave one node of the range
    assert (cfg.batch_size, cfg.accum_steps, cfg.global_batch_size) == (8, 4, 64)
    assert cfg.lr == planned_lr


@pytest.mark.parametrize(
    "flags", [["--exchange", "ring"], ["--deepspeed"], ["--ps-servers", "1"], ["--tp", "2"]]
)
def test_an_override_of_the_engine_or_layout_is_refused(tmp_path, flags):
    plan = planned(tmp_path, args="--exchange ps")
    with pytest.raises(ConfigError, match=f"^{flags[0]} with --plan .*plan the run again"):
        parse_args(plan_argv(plan, *flags), world_size=plan.spec.world_size)


def test_a_plan_of_the_old_version_is_refused_with_the_fix(tmp_path):
    plan = planned(tmp_path)
    path = plan.run_dir / "plan.json"
    data = json.loads(path.read_text())
    del data["trainer"]
    path.write_text(json.dumps({**data, "version": 1}))
    with pytest.raises(
        ConfigError, match=r"plan\.json: version 1; this vitpod reads 2: plan the run again"
    ):
        parse_args(plan_argv(plan), world_size=4)


def test_a_plan_whose_trainer_section_is_wrong_names_the_key(tmp_path):
    plan = planned(tmp_path)
    path = plan.run_dir / "plan.json"
    data = json.loads(path.read_text())
    data["trainer"]["optim"]["batch_size"] = "sixteen"
    path.write_text(json.dumps(data))
    with pytest.raises(
        RecordError, match=r"trainer: .*optim\.batch_size: Input should be a valid integer"
    ):
        read_decision(plan.run_dir)
    data["trainer"]["optim"]["batch_size"] = 16
    data["trainer"]["run"]["batch"] = 16
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"run\.batch: not a trainer setting"):
        read_decision(plan.run_dir)


def test_a_rank_started_with_a_disagreeing_flag_exits_2_before_training(tmp_path):
    """As a user meets it: the job's own command line plus one flag, run as a rank runs it."""
    plan = planned(tmp_path, args="--exchange ps")
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": str(plan.spec.world_size),
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "vitpod.trainer", *plan_argv(plan, "--exchange", "ring")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "plan.json" in lines[0] and "--exchange with" in lines[0], (
        done.stderr
    )
    assert not (plan.run_dir / "metrics").exists()  # refused before any rank trained


@pytest.mark.parametrize(
    "args, engine",
    [("--deepspeed", "deepspeed"), ("--fsdp", "fsdp"), ("--exchange ring", "ring"), ("", None)],
)
def test_the_planner_and_the_rank_name_the_engine_by_one_rule(tmp_path, args, engine):
    plan = planned(tmp_path, args=args)
    engine = engine or plan.decision.engine.name  # "": the cost model chose ring or ps
    assert plan.decision.engine.name == engine
    assert parse_args(plan_argv(plan), world_size=4).engine == engine
    if engine in ("deepspeed", "fsdp"):
        assert plan.decision.trainer.model["channels_last"] is False  # they need NCHW weights


def test_the_engine_registry_builds_every_engine_the_rule_names():
    from vitpod.registry.engines import ENGINES
    from vitpod.trainer.engines.parallel import BUILDERS

    assert sorted(BUILDERS) == sorted(ENGINES)


def test_two_engines_asked_for_at_once_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(WorkflowError, match="--deepspeed and --fsdp/--tp/--pp both shard"):
        planned(tmp_path, args="--deepspeed --fsdp")
    assert not (tmp_path / "runs").exists()
