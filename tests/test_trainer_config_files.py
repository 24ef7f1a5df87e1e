"""-c/--config: timm's args.yaml and vitpod's config.json/args.yaml, the one precedence
(command line > config file > recipe > defaults), and the published VOLO-D5 pretrain command
resolved alike by distributed_train.sh and by the planner."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import QUICK, logs, run_ranks
from tests.test_trainer_config import PRETRAIN
from vitpod.trainer.config import ConfigError
from vitpod.trainer.settings.flags import parse_args
from vitpod.trainer.settings.timmargs import TIMM
from vitpod.workflows.errors import ConfigError as PlanError
from vitpod.workflows.planning.plan import Request, plan_job

REPO = Path(__file__).resolve().parents[1]
TIMM_ARGS = REPO / "tests" / "fixtures" / "timm" / "args.yaml"


def timm_args(tmp_path: Path, **changes) -> Path:
    """The fixture (timm train.py's own args.yaml) with some keys changed."""
    data = yaml.safe_load(TIMM_ARGS.read_text())
    path = tmp_path / "args.yaml"
    path.write_text(yaml.safe_dump({**data, **changes}))
    return path


def test_dash_c_reads_timms_args_yaml_and_maps_its_keys() -> None:
    cfg = parse_args(["-c", str(TIMM_ARGS)])
    assert (cfg.data_dir, cfg.model, cfg.batch_size, cfg.epochs) == (
        "/data/imagenet", "volo_d1_224", 64, 20,
    )  # fmt: skip
    assert (cfg.lr, cfg.warmup_epochs, cfg.warmup_lr, cfg.min_lr) == (1.6e-3, 20, 1e-6, 1e-5)
    assert (cfg.opt, cfg.weight_decay, cfg.drop_path, cfg.smoothing) == ("adamw", 0.05, 0.1, 0.1)
    assert (cfg.amp, cfg.amp_dtype, cfg.aa, cfg.reprob) == (
        True, "bf16", "rand-m9-mstd0.5-inc1", 0.25,
    )  # fmt: skip
    assert cfg.dataset == "folder" and cfg.scale == (0.08, 1.0)
    assert cfg.config == str(TIMM_ARGS)
    # The table knows every key timm's train.py writes; output and experiment: timm's layout.
    assert set(yaml.safe_load(TIMM_ARGS.read_text())) <= set(TIMM)
    assert cfg.output == "/runs/volo-d1"


def test_timm_keys_vitpod_lacks_are_refused_in_one_message_unless_at_timms_default(tmp_path):
    path = timm_args(tmp_path, jsd_loss=True, vflip=0.5, lr_cycle_limit=3, split_bn=False)
    with pytest.raises(ConfigError) as err:
        parse_args(["-c", str(path)])
    message = str(err.value)
    assert message.startswith(f"--config {path} (timm's args.yaml): --jsd-loss: in timm, the ")
    for named in (
        "--vflip 0.5: in timm, flips images vertically; vitpod's loaders flip "
        "horizontally only (--hflip)",
        "--lr-cycle-limit 3: in timm, restart cycles",
    ):
        assert named in message
    assert "split" not in message.replace("splits", "")  # at timm's default: asks nothing
    assert "docs/trainer.md#timms-trainpy-options" in message


def test_timm_values_vitpod_cannot_take_are_refused_naming_the_key(tmp_path) -> None:
    # timm's optimizer and schedule keys map to vitpod's flags (timm's factories build them).
    cfg = parse_args(["-c", str(timm_args(tmp_path, opt="sgd", momentum=0.8, sched="step",
                                          decay_epochs=30, opt_betas=None))])  # fmt: skip
    assert (cfg.opt, cfg.momentum, cfg.sched, cfg.decay_epochs) == ("sgd", 0.8, "step", 30)
    with pytest.raises(ConfigError, match=r"argument --decay-rate/--dr: invalid float value: 'x'"):
        parse_args(["-c", str(timm_args(tmp_path, decay_rate="x"))])
    # timm scales lr_base by sqrt(batch) for AdamW when lr is unset; vitpod linearly.
    with pytest.raises(ConfigError, match=r"lr: None with lr_base_scale 'sqrt'.*give lr"):
        parse_args(["-c", str(timm_args(tmp_path, lr=None))])
    linear = parse_args(["-c", str(timm_args(tmp_path, lr=None, lr_base_scale="linear"))])
    assert linear.lr == pytest.approx(0.1 * 64 / 256)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['mix_token'\]"):
        parse_args(["-c", str(timm_args(tmp_path, mix_token=True))])


def test_vitpod_config_values_are_checked_like_flags(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 2.5\n")
    with pytest.raises(ConfigError, match=r"--config .*c.yaml: argument --epochs: invalid int"):
        parse_args(["-c", str(path)])
    path.write_text("eval: 'no'\n")
    with pytest.raises(ConfigError, match=r"eval: 'no'; write true or false"):
        parse_args(["-c", str(path)])
    with pytest.raises(ConfigError, match=r"--config /no/such.yaml: no such file"):
        parse_args(["--config", "/no/such.yaml"])


def test_precedence_command_line_then_config_file_then_defaults(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 20\nwarmup-epochs: 2\n")
    assert parse_args(["d"]).epochs == 300
    assert parse_args(["d", "-c", str(path)]).epochs == 20
    for argv in (["d", "--epochs", "9", "-c", str(path)], ["d", "-c", str(path), "--epochs=9"]):
        cfg = parse_args(argv)
        assert (cfg.epochs, cfg.warmup_epochs) == (9, 2)


def test_a_config_file_in_args_beats_the_recipe_and_the_command_line_beats_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 30\noutput: /elsewhere\ntoken_label: false\n")

    def planned(args: str) -> dict:
        req = Request(cluster="dgxpod", model="volo_d5", nodes=1, args=args,
                      run_root=str(tmp_path / "runs"))  # fmt: skip
        plan = plan_job(req)
        assert "--config" not in plan.spec.command and "-c" not in plan.spec.command
        return plan.trainer

    assert planned("")["epochs"] == 300  # the recipe's
    cfg = planned(f"-c {path}")
    assert (cfg["epochs"], cfg["token_label"]) == (30, False)  # the file's, over the recipe's
    assert cfg["output"].startswith(str(tmp_path / "runs"))  # the planner's run directory
    assert planned(f"-c {path} --epochs 40")["epochs"] == 40
    path.write_text("jsd_loss: true\nsched: cosine\n")
    with pytest.raises(PlanError, match=r"^ARGS: --config .*--jsd-loss: in timm, "):
        planned(f"-c {path}")


def _via_distributed_train_sh(command: str, tmp_path: Path) -> tuple[int, list[str]]:
    """What distributed_train.sh hands torchrun: (ranks on this node, the trainer's argv)."""
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\n')
    shim.chmod(0o755)
    done = subprocess.run(
        [str(REPO / "distributed_train.sh"), *shlex.split(command)],
        env={**os.environ, "PYTHON": str(shim)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    nproc = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--nproc-per-node="))
    return nproc, argv[argv.index("vitpod.trainer") + 1 :]


def test_published_volo_d5_pretrain_resolves_alike_through_both_entry_points(tmp_path):
    """The blog's command via distributed_train.sh (8 GPUs) and `make pretrain MODEL=volo_d5
    NODES=1 ARGS=<its flags>` on the 8-GPU DGX A100 partition: one trainer configuration."""
    nproc, argv = _via_distributed_train_sh(f"8 {PRETRAIN}", tmp_path)
    by_hand = parse_args(argv, world_size=nproc).record()
    args = shlex.join(argv[1:])  # the planner owns the data path
    plan = plan_job(Request(cluster="dgxpod", model="volo_d5", stage="pretrain", nodes=1,
                            args=args, run_root=str(tmp_path / "runs")))  # fmt: skip
    planned = plan.trainer
    assert planned is not None and plan.spec.world_size == nproc == 8
    for key in ("epochs", "warmup_epochs", "lr", "batch_size", "drop_path", "token_label",
                "token_label_size", "token_label_data", "weight_decay", "crop_pct"):  # fmt: skip
        assert planned[key] == by_hand[key], key
    assert (by_hand["warmup_epochs"], by_hand["lr"], by_hand["batch_size"]) == (20, 1e-4, 44)
    as_json = {k: list(v) if isinstance(v, tuple) else v for k, v in by_hand.items()}
    differ = {k for k in planned if k in by_hand and planned[k] != as_json[k]}
    # Where the planner puts the data and the run, the ring-or-ps choice it made, and dgxpod's
    # `checkpoint: {every: auto}`: no run measured a step yet, so it checkpoints at epoch ends.
    assert differ == {"data_dir", "output", "exchange", "checkpoint_every"}
    assert planned["exchange"] == plan.decision.engine.name
    assert planned["checkpoint_every"] == plan.decision.checkpoint.steps == 0


def test_recipe_alone_gives_the_published_unstated_values() -> None:
    """Without ARGS the pretrain recipe's warm-up is what the published command ran with."""
    by_hand = parse_args(shlex.split(PRETRAIN), world_size=8)
    plan = plan_job(Request(cluster="dgxpod", model="volo_d5", nodes=1, offline=True))
    assert plan.trainer is not None
    assert plan.trainer["warmup_epochs"] == by_hand.warmup_epochs == 20
    assert plan.trainer["epochs"] == by_hand.epochs == 300


def test_a_run_writes_args_yaml_and_both_its_files_give_its_configuration_back(
    digits_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text("seed: 7\nhflip: 0.25\n")
    argv = [str(digits_dir), "--dataset", "digits", *QUICK, "--output", str(run), "-c", str(config)]
    assert run_ranks(1, argv, tmp_path / "logs") == [0], logs(tmp_path / "logs")
    written = yaml.safe_load((run / "args.yaml").read_text())
    assert (written["seed"], written["hflip"], written["lr"]) == (7, 0.25, None)  # as parsed
    # ... but what the run resolved from the data, the model and the loader is written as
    # such (timm's train.py reads null as 1000 classes and the model's normalisation).
    resolved = {"num_classes": 10, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    assert {k: written[k] for k in resolved} == resolved
    original = parse_args(argv).record()
    again = parse_args(["-c", str(run / "args.yaml")]).record()
    assert {k: v for k, v in again.items() if original[k] != v} == {
        "config": str(run / "args.yaml"), **{k: tuple(v) if k != "num_classes" else v
                                             for k, v in resolved.items()},
    }  # fmt: skip
    recorded = json.loads((run / "config.json").read_text())
    fed_back = json.loads(json.dumps(parse_args(["--config", str(run / "config.json")]).record()))
    assert {k: v for k, v in fed_back.items() if recorded[k] != v} == {
        "config": str(run / "config.json")
    }


def test_print_config_output_feeds_back_too(tmp_path) -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "vitpod.trainer", "--print-config", *shlex.split(PRETRAIN)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    path = tmp_path / "printed.json"
    path.write_text(printed.stdout)
    cfg = parse_args(["-c", str(path)], world_size=1).record()
    assert cfg == {**parse_args(shlex.split(PRETRAIN)).record(), "config": str(path)}
