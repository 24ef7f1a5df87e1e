"""--num-classes not given: the class count comes from the data set, not a default of 1000."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tests.helpers import QUICK, logs, run_ranks
from vitpod.trainer.__main__ import main
from vitpod.trainer.data import DataConfig
from vitpod.trainer.data.sources import SYNTHETIC_CLASSES, count_classes
from vitpod.trainer.exitcodes import OK
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.settings.flags import parse_args
from vitpod.workflows.planning.exchange import grad_bytes
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.planning.recipe import load_recipe

# One optimizer step of the tiny VOLO on digits: the command, made cheap.


def _three_class_folder(digits_dir: Path, root: Path) -> Path:
    for split in ("train", "val"):
        for cls in ("0", "1", "2"):
            dest = root / split / cls
            dest.mkdir(parents=True)
            for src in sorted((digits_dir / split / cls).glob("*.jpg"))[:2]:
                shutil.copy(src, dest / src.name)
    return root


def _cifar100_meta(root: Path) -> Path:
    """Only the meta file: counting the classes must not read the image batches."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    names = [f"class{i}".encode() for i in range(100)]
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": names}))
    return root


def test_flag_default_is_not_given_and_passes_validation() -> None:
    cfg = parse_args(["/data"])
    assert cfg.num_classes is None
    assert not [p for p in problems(cfg, for_training=False) if "num-classes" in p]
    assert parse_args(["/data", "--num-classes", "7"]).num_classes == 7


def test_each_source_counts_its_own_classes(digits_dir: Path, tmp_path: Path) -> None:
    folder = _three_class_folder(digits_dir, tmp_path / "three")
    assert count_classes(DataConfig(data_dir=str(folder))) == 3
    assert count_classes(DataConfig(dataset="digits", data_dir=str(tmp_path / "unwritten"))) == 10
    assert not (tmp_path / "unwritten").exists()  # counting digits writes no images
    cifar = _cifar100_meta(tmp_path / "c100")
    assert count_classes(DataConfig(dataset="cifar100", data_dir=str(cifar))) == 100
    assert count_classes(DataConfig(dataset="synthetic")) == SYNTHETIC_CLASSES
    assert count_classes(DataConfig(dataset="synthetic", num_classes=7)) == 7


def test_digits_without_num_classes_trains_a_10_class_model(digits_dir: Path, tmp_path: Path):
    """The issue: `--dataset digits` without --num-classes failed with 'num_classes=1000'."""
    run = tmp_path / "run"
    argv = [str(digits_dir), "--dataset", "digits", *QUICK, "--output", str(run)]
    codes = run_ranks(1, argv, tmp_path / "logs")
    assert codes == [0], logs(tmp_path / "logs")
    assert json.loads((run / "final" / "model.json").read_text())["num_classes"] == 10
    assert json.loads((run / "config.json").read_text())["num_classes"] == 10  # kept resolved


def test_explicit_num_classes_that_disagrees_still_fails_clearly(digits_dir: Path, tmp_path):
    argv = [str(digits_dir), *QUICK, "--num-classes", "7", "--output", str(tmp_path / "run")]
    assert run_ranks(1, argv, tmp_path / "logs") == [2]
    assert "drop --num-classes or set it to 10" in logs(tmp_path / "logs")


def test_print_config_shows_the_counted_classes_when_the_data_is_there(
    digits_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _three_class_folder(digits_dir, tmp_path / "three")
    assert main(["--print-config", str(folder), "--model", "volo_tiny"]) == OK
    assert json.loads(capsys.readouterr().out)["num_classes"] == 3
    assert main(["--print-config", "/nowhere", "--model", "volo_tiny"]) == OK  # no data: null
    assert json.loads(capsys.readouterr().out)["num_classes"] is None


def test_recipes_pass_num_classes_only_when_they_set_it(tmp_path: Path) -> None:
    imagenet = load_recipe("volo_d1").stage("pretrain")
    assert imagenet.num_classes is None and "--num-classes" not in imagenet.trainer_flags()
    tiny = load_recipe("volo_tiny").stage("pretrain").trainer_flags()
    assert tiny[tiny.index("--num-classes") + 1] == "10"
    # The login-node planner sizes gradients without the data: an ImageNet head (1000 classes).
    plan = plan_job(Request(cluster="dgxpod", model="volo_d5", run_root=str(tmp_path)))
    assert "--num-classes" not in plan.spec.command
    assert plan.decision.costs.grad_bytes == grad_bytes("volo_d5", 1000)
