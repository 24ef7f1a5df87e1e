"""Published commands run unchanged: sail-sg/volo's README (VOLO-D1 pretrain and fine-tune) and
timm's documented train.py command lines with a ViT, through distributed_train.sh and the
planner (`make pretrain/render ARGS=...`), to the intended configuration; a recipe's warmup
shortens to fit a short run, a typed one does not."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import pytest
import yaml

from tests.helpers import make
from tests.test_bad_input_refused import VENV
from tests.test_trainer_config_files import _via_distributed_train_sh
from vitpod.registry.decision import write_decision
from vitpod.trainer.config import ConfigError
from vitpod.trainer.settings.flags import _say_once, parse_args
from vitpod.trainer.settings.timmargs import args_yaml
from vitpod.workflows.errors import ConfigError as PlanError
from vitpod.workflows.planning.plan import Request, plan_job

# github.com/sail-sg/volo README.md, "4. Train": volo_d1 at 224, then fine-tuned at 384.
VOLO_D1 = """8 /path/to/imagenet \\
  --model volo_d1 --img-size 224 \\
  -b 128 --lr 1.6e-3 --drop-path 0.1 --apex-amp \\
  --token-label --token-label-size 14 --token-label-data /path/to/token_label_data"""
VOLO_D1_384 = """8 /path/to/imagenet \\
  --model volo_d1 --img-size 384 \\
  -b 64 --lr 8.0e-6 --min-lr 4.0e-6 --drop-path 0.1 --epochs 30 --apex-amp \\
  --weight-decay 1.0e-8 --warmup-epochs 5  --ground-truth \\
  --token-label --token-label-size 24 --token-label-data /path/to/token_label_data \\
  --finetune /path/to/pretrained_224_volo_d1/"""
# huggingface/pytorch-image-models hfdocs/source/training_script.mdx: its documented
# EfficientNet-B2 RandAugment command (timm's docs give no ViT command) with a ViT as --model.
TIMM_B2 = """2 --data-dir /imagenet/ --model vit_base_patch16_224 -b 128 --sched step --epochs 450
  --decay-epochs 2.4 --decay-rate .97 --opt rmsproptf --opt-eps .001 -j 8 --warmup-lr 1e-6
  --weight-decay 1e-5 --drop 0.3 --drop-path 0.2 --model-ema --model-ema-decay 0.9999
  --aa rand-m9-mstd0.5 --remode pixel --reprob 0.2 --amp --lr .016"""


def by_hand(command: str, tmp_path: Path) -> tuple[int, list[str], dict]:
    command = command.replace("\\\n", " ")  # the shell's line continuations
    nproc, argv = _via_distributed_train_sh(command, tmp_path)
    return nproc, argv, parse_args(argv, world_size=nproc).record()


def planned(model: str, flags: list[str], tmp_path: Path, **request) -> dict:
    """`make render MODEL=... ARGS=<flags> OFFLINE=1` (the data path and run are the planner's)."""
    plan = plan_job(Request(cluster="dgxpod", model=model, nodes=1, args=shlex.join(flags),
                            run_root=str(tmp_path / "runs"), offline=True, **request))  # fmt: skip
    assert plan.trainer is not None
    return plan.trainer


def test_sail_sg_volo_readme_commands_resolve_as_written(tmp_path: Path) -> None:
    nproc, argv, cfg = by_hand(VOLO_D1, tmp_path)
    assert nproc == 8 and cfg["data_dir"] == "/path/to/imagenet"
    assert (cfg["model"], cfg["img_size"], cfg["batch_size"], cfg["lr"]) == (
        "volo_d1", 224, 128, 1.6e-3)  # fmt: skip
    assert (cfg["drop_path"], cfg["amp"], cfg["token_label"], cfg["token_label_size"]) == (
        0.1, True, True, 14)  # fmt: skip
    assert (cfg["epochs"], cfg["warmup_epochs"]) == (300, 20)  # main.py's, unstated
    plan = planned("volo_d1", argv[1:], tmp_path)
    for key in ("model", "img_size", "batch_size", "lr", "drop_path", "amp", "token_label",
                "token_label_size", "epochs", "warmup_epochs"):  # fmt: skip
        assert plan[key] == cfg[key], key

    _, argv, ft = by_hand(VOLO_D1_384, tmp_path)
    assert (ft["img_size"], ft["batch_size"], ft["lr"], ft["min_lr"], ft["epochs"]) == (
        384, 64, 8.0e-6, 4.0e-6, 30)  # fmt: skip
    assert (ft["weight_decay"], ft["warmup_epochs"], ft["ground_truth"]) == (1e-8, 5, True)
    assert (ft["token_label_size"], ft["finetune"]) == (24, "/path/to/pretrained_224_volo_d1/")
    pretrained = tmp_path / "pre"
    (pretrained / "final").mkdir(parents=True)
    (pretrained / "final" / "model.pt").write_bytes(b"x")
    flags = argv[1 : argv.index("--finetune")]  # FINETUNE_FROM= is the planner's --finetune
    plan = planned("volo_d1", flags, tmp_path, stage="finetune", finetune_from=str(pretrained))
    for key in ("img_size", "batch_size", "lr", "min_lr", "epochs", "weight_decay",
                "warmup_epochs", "ground_truth", "token_label_size"):  # fmt: skip
        assert plan[key] == ft[key], key


def test_timms_documented_command_with_a_vit_resolves_to_timms_meaning(tmp_path: Path) -> None:
    nproc, argv, cfg = by_hand(TIMM_B2, tmp_path)
    assert nproc == 2 and cfg["data_dir"] == "/imagenet/"
    expected = {"model": "vit_base_patch16_224", "batch_size": 128, "sched": "step",
                "epochs": 450, "decay_epochs": 2.4, "decay_rate": 0.97, "opt": "rmsproptf",
                "opt_eps": 0.001, "workers": 8, "warmup_lr": 1e-6, "weight_decay": 1e-5,
                "drop": 0.3, "drop_path": 0.2, "model_ema": True, "model_ema_decay": 0.9999,
                "aa": "rand-m9-mstd0.5", "reprob": 0.2, "amp": True, "lr": 0.016}  # fmt: skip
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["no_effect"] == {}  # --remode pixel is timm's default: asks nothing
    data = argv.index("--data-dir")
    plan = planned("vit_base_patch16_224", argv[:data] + argv[data + 2 :], tmp_path)
    assert {k: plan[k] for k in expected} == expected


@pytest.mark.parametrize("via", ["make", "chain"])
def test_a_short_run_of_a_recipe_fits_its_warmup_and_a_typed_warmup_is_refused(
    via: str, tmp_path: Path
) -> None:
    """README's `make render ... ARGS="--epochs 10" OFFLINE=1` and `Chain(..., args="--epochs
    10").plan()`: volo_d5's 20 warmup epochs of 300 become 1 of 10."""
    runs = tmp_path / "runs"
    if via == "make":
        out = make("render", "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5", "ARGS=--epochs 10",
                   "OFFLINE=1", VENV, runs=runs)  # fmt: skip
        assert out.returncode == 0, out.stderr
        plan = json.loads(next(runs.rglob("plan.json")).read_text())
        optim = plan["trainer"]["optim"]
        assert (optim["epochs"], optim["warmup_epochs"]) == (10, 1)
        assert "the recipe's 20 does not fit --epochs 10; warming up 1" in out.stderr
        typed = make("render", "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5",
                     "ARGS=--epochs 10 --warmup-epochs 20", "OFFLINE=1", VENV,
                     runs=tmp_path / "typed")  # fmt: skip
        assert typed.returncode != 0
        assert "--warmup-epochs 20: must be in [0, --epochs 10)" in typed.stderr
        return
    from vitpod.workflows.pipeline.chain import Chain

    records = Chain(cluster="dgxpod", model="volo_d5", nodes=5, args="--epochs 10",
                    run_root=str(runs), offline=True).plan()  # fmt: skip
    trainer = records["pretrain"].plan.trainer
    assert (trainer["epochs"], trainer["warmup_epochs"]) == (10, 1)
    with pytest.raises(PlanError, match=r"--warmup-epochs 20: must be in \[0, --epochs 10\)"):
        Chain(cluster="dgxpod", model="volo_d5", nodes=5, args="--epochs 10 --warmup-epochs 20",
              run_root=str(runs), offline=True).plan()  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "why"),
    [("--experiment", "vitpod names the run directory"), ("--data-dir", "storage.data")],
)
def test_timm_flags_that_name_the_run_or_data_are_the_planners(flag, why, tmp_path) -> None:
    with pytest.raises(PlanError, match=f"ARGS: {flag} is set by vitpod .*{why}"):
        planned("volo_d1", [flag, "x"], tmp_path)


def test_a_planned_runs_no_effect_flags_reach_the_ranks_config_json_and_args_yaml(
    tmp_path: Path,
) -> None:
    """`make pretrain ARGS="--pin-mem --tta 2"`: plan.json's trainer section carries the flags
    of no effect, so a rank started from it (--plan) records them in config.json's no_effect
    and args.yaml as a run typed by hand does (they were in manifest.json only)."""
    plan = plan_job(Request(cluster="dgxpod", model="volo_d1", nodes=1, args="--pin-mem --tta 2",
                            run_root=str(tmp_path / "runs"), offline=True))  # fmt: skip
    assert plan.decision is not None and plan.decision.trainer is not None
    run = tmp_path / "run"
    run.mkdir()
    write_decision(run, plan.decision)
    assert json.loads((run / "plan.json").read_text())["trainer"]["no_effect"] == {
        "pin_mem": True, "tta": 2}  # fmt: skip
    rank = parse_args(["--plan", str(run / "plan.json")], world_size=8)
    by_hand = parse_args(["/d", "--pin-mem", "--tta", "2"])
    assert set(rank.no_effect) == {"--pin-mem", "--tta"} and rank.no_effect == by_hand.no_effect
    assert json.loads(rank.to_json())["no_effect"] == by_hand.no_effect  # config.json
    written = yaml.safe_load(args_yaml(rank))
    assert (written["pin_mem"], written["tta"]) == (True, 2)
    # A plan edited to carry what is not a no-effect flag is refused naming the key.
    text = (run / "plan.json").read_text().replace('"tta": 2', '"jsd_loss": true')
    (run / "plan.json").write_text(text)
    with pytest.raises(ConfigError, match=r"trainer\.no_effect: \['jsd_loss'\]: not timm"):
        parse_args(["--plan", str(run / "plan.json")], world_size=8)


def test_a_warmup_that_does_not_fit_says_where_it_came_from(caplog) -> None:
    """No recipe (vitpod-train by hand): the default's 20 epochs, not 'the recipe's'."""
    _say_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        cfg = parse_args(["/d", "--epochs", "10"])
    assert cfg.warmup_epochs == 1
    assert "--warmup-epochs: vitpod's default 20 does not fit --epochs 10" in caplog.text
    assert "recipe" not in caplog.text
