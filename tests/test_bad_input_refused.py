"""Bad input typed as a user types it is refused before anything is written: exit 2, one line
naming the field and the fix, no run directory (issue 28 item 7)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make, vitpod
from vitpod.registry.decision import read_decision

VENV = f"VENV={Path(sys.executable).parent.parent}"  # make: this interpreter's environment


def _refused(out: subprocess.CompletedProcess[str], runs: Path, *needles: str) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, out.stderr  # one line (make adds its own `make: ***` after it)
    line = errors[0]
    for needle in needles:
        assert needle in line, line
    assert not runs.exists(), list(runs.rglob("*"))
    return line


def test_finetune_from_a_missing_run_is_refused_at_render(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    out = vitpod("render", "--cluster", "dgxpod", "--model", "volo_d5", "--stage",
                 "finetune", "--finetune-from", "runs/does-not-exist", runs=runs)  # fmt: skip
    _refused(out, runs, "FINETUNE_FROM='runs/does-not-exist' does not exist", "give a pretrain")
    # A run that exists renders (the same check passes); OFFLINE=1 renders for another machine.
    pretrain = tmp_path / "pre"
    (pretrain / "final").mkdir(parents=True)
    (pretrain / "final" / "model.pt").write_bytes(b"x")
    ok = vitpod("render", "--cluster", "dgxpod", "--model", "volo_d5", "--stage",
                "finetune", "--finetune-from", str(pretrain), runs=runs)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert Path(ok.stdout.strip().splitlines()[-1]).is_file()


def test_an_empty_finetune_model_is_refused_at_render(tmp_path: Path) -> None:
    """A final/model.pt cut to 0 bytes (a copy that stopped), in a run or given as the file."""
    runs, pretrain = tmp_path / "runs", tmp_path / "pre"
    (pretrain / "final").mkdir(parents=True)
    (pretrain / "final" / "model.pt").write_bytes(b"")
    for source in (pretrain, pretrain / "final" / "model.pt"):
        out = vitpod("render", "--cluster", "dgxpod", "--model", "volo_d5", "--stage",
                     "finetune", "--finetune-from", str(source), runs=runs)  # fmt: skip
        _refused(out, runs, f"{pretrain / 'final' / 'model.pt'} is empty (0 bytes", "copy the")


def test_a_finetune_model_shorter_than_its_manifest_says_is_refused(tmp_path: Path) -> None:
    """A final/model.pt cut short but not empty: final/manifest.json records its size."""
    runs, final = tmp_path / "runs", tmp_path / "pre" / "final"
    final.mkdir(parents=True)
    (final / "model.pt").write_bytes(b"x" * 10)
    (final / "manifest.json").write_text('{"file": "model.pt", "bytes": 10}')
    argv = ("render", "--cluster", "dgxpod", "--model", "volo_d5", "--stage", "finetune",
            "--finetune-from", str(final.parent))  # fmt: skip
    assert vitpod(*argv, runs=runs).returncode == 0
    (final / "model.pt").write_bytes(b"x" * 4)
    shutil.rmtree(runs)
    _refused(vitpod(*argv, runs=runs), runs, "model.pt is 4 bytes, its manifest.json says 10")


def test_finetune_from_on_a_pretrain_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    out = make("render", "CLUSTER=dgxpod", "MODEL=volo_d5", "STAGE=pretrain",
               f"FINETUNE_FROM={tmp_path}", VENV, runs=runs)  # fmt: skip
    _refused(out, runs, "FINETUNE_FROM=", "pretrain stage starts from scratch", "STAGE=finetune")
    out = make("pretrain", "CLUSTER=local", "MODEL=volo_tiny", f"FINETUNE_FROM={tmp_path}", VENV,
               runs=runs)  # fmt: skip
    _refused(out, runs, "FINETUNE_FROM=", "drop FINETUNE_FROM")


def test_teacher_given_to_a_stage_that_does_not_use_it_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    weights = tmp_path / "teacher.pth"
    weights.write_bytes(b"x")
    # vit_base_patch16_224's recipe has no token labels: the pipeline would ignore TEACHER.
    out = make("pipeline", "CLUSTER=dgxpod", "MODEL=vit_base_patch16_224", "OFFLINE=1",
               f"TEACHER={weights}", VENV, runs=runs)  # fmt: skip
    _refused(out, runs, "TEACHER=", "trains with token labels", "drop TEACHER")
    # A single-stage target never makes labels.
    out = make("render", "CLUSTER=dgxpod", "MODEL=volo_d5", f"TEACHER={weights}", VENV, runs=runs)
    assert out.returncode == 2 and "TEACHER/TEACHER_CKPT" in out.stderr and not runs.exists()


def test_a_teacher_that_cannot_label_is_refused_at_planning(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    weights = tmp_path / "nfnet.pth"
    weights.write_bytes(b"x")
    data = tmp_path / "data"
    (data / "imagenet" / "train").mkdir(parents=True)
    common = ["token-labels", "--cluster", "dgxpod", "--model", "volo_d5",
              "--teacher-checkpoint", str(weights)]  # fmt: skip
    # NFNet's final map is 1/32 of the image: 7x7 at 224 px, not vitpod's 14x14.
    out = vitpod(*common, "--teacher", "dm_nfnet_f6", runs=runs)
    _refused(out, runs, "TEACHER='dm_nfnet_f6'", "1/32", "14x14", "--layout published")
    out = vitpod(*common, "--teacher", "dm_nfnet_f66", runs=runs)
    _refused(out, runs, "not a timm model", "did you mean dm_nfnet_f6")


def test_timm_model_names_map_to_their_recipe(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    out = vitpod("render", "--cluster", "dgxpod", "--model", "volo_d5_224", "--offline", runs=runs)
    assert out.returncode == 0, out.stderr
    script = Path(out.stdout.strip().splitlines()[-1])
    assert "-volo_d5-pretrain-" in script.parent.name
    trainer = read_decision(script.parent).trainer
    assert (trainer.model["model"], trainer.data["img_size"]) == ("volo_d5", 224)
    out = vitpod("render", "--cluster", "dgxpod", "--model", "volo_d55", runs=tmp_path / "none")
    _refused(out, tmp_path / "none", "MODEL='volo_d55'", "did you mean MODEL=volo_d5?")


@pytest.mark.parametrize("model", ["volo_d5_224", "volo_d1_224"])
def test_a_timm_name_plans_like_its_recipe(model: str) -> None:
    from vitpod.workflows.planning.recipe import load_recipe

    assert load_recipe(model).model == model.removesuffix("_224")
