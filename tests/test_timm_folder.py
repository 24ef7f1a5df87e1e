"""Checkpoints that cross over: a run's final folder loads in plain timm (`local-dir:`), and
--finetune reads what timm writes (its train.py checkpoints, its local model folders)."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from timm.utils import CheckpointSaver, ModelEmaV3

from tests.helpers import logs, run_ranks
from vitpod.registry import models as registry
from vitpod.registry import runfiles
from vitpod.trainer.checkpointing.checkpoint import save_final
from vitpod.trainer.model.models import ModelLoadError, create_model, load_finetune, model_manifest

TRAIN = [
    "--dataset", "digits", "--model", "vit_micro", "--img-size", "32", "--num-classes", "10",
    "-b", "8", "--workers", "0", "--loader", "torch", "--aa", "", "--reprob", "0",
    "--checkpoint-every", "0", "--log-interval", "1000", "--seed", "5", "--no-eval",
    "--max-steps", "2", "--crop-pct", "0.9",
]  # fmt: skip

# Runs with no vitpod on sys.path (cwd is the folder's parent, not the checkout): it writes
# timm's logits for the saved input and fails if anything imported vitpod.
TIMM_ONLY = """
import sys, timm, torch
folder, images, out = sys.argv[1:]
model = timm.create_model("local-dir:" + folder, pretrained=True).eval()
with torch.no_grad():
    torch.save(model(torch.load(images)), out)
json = __import__("json")
print(json.dumps(timm.data.resolve_data_config({}, model=model)))
assert not [m for m in sys.modules if m.split(".")[0] == "vitpod"], "vitpod was imported"
"""


def timm_logits(folder: Path, images: torch.Tensor, tmp: Path) -> tuple[torch.Tensor, dict]:
    """Logits and data config of `folder` as plain timm loads it, in a fresh interpreter."""
    torch.save(images, tmp / "images.pt")
    done = subprocess.run(
        [sys.executable, "-c", TIMM_ONLY, str(folder), str(tmp / "images.pt"), str(tmp / "out.pt")],
        cwd=tmp, capture_output=True, text=True, timeout=300, check=False,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp / "out.pt"), json.loads(done.stdout.splitlines()[-1])


def vitpod_logits(run: Path, name: str, images: torch.Tensor) -> torch.Tensor:
    model = create_model(name, images.shape[-1], 10, 0.0).eval()
    model.load_state_dict(torch.load(runfiles.final_model(run), weights_only=True))
    with torch.no_grad():
        return model(images)


@pytest.fixture(scope="module")
def trained(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vit_micro run the real trainer finished (1 gloo rank, 2 steps): its run directory."""
    run = tmp_path_factory.mktemp("timm-folder") / "run"
    codes = run_ranks(1, [str(digits_dir), *TRAIN, "--output", str(run)], run.parent / "logs")
    assert codes == [0], logs(run.parent / "logs")
    return run


@pytest.mark.slow
def test_the_trainers_final_folder_loads_in_plain_timm_with_vitpods_outputs(
    trained: Path, tmp_path: Path
) -> None:
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    got, data = timm_logits(trained / runfiles.FINAL, images, tmp_path)
    torch.testing.assert_close(got, vitpod_logits(trained, "vit_micro", images), rtol=0, atol=0)
    assert data["input_size"] == [3, 32, 32]
    assert data["crop_pct"] == 0.9  # the run's --crop-pct, not vit_base's default
    config = json.loads((trained / runfiles.FINAL / runfiles.TIMM_CONFIG).read_text())
    assert config["architecture"] == registry.VIT_TIMM_BASE
    assert config["model_args"]["embed_dim"] == 64 and config["num_classes"] == 10


@pytest.mark.slow
def test_the_final_manifest_records_every_files_sha256(trained: Path) -> None:
    from vitpod.trainer.checkpointing.torchsave import sha256_of

    final = trained / runfiles.FINAL
    manifest = json.loads((final / runfiles.FINAL_RECORD).read_text())
    assert manifest["sha256"] == sha256_of(final / runfiles.FINAL_MODEL)
    recorded = manifest["timm"]["files"]
    assert set(recorded) == {runfiles.TIMM_WEIGHTS, runfiles.TIMM_CONFIG}
    for name, info in recorded.items():
        assert info == {"sha256": sha256_of(final / name), "bytes": (final / name).stat().st_size}


@pytest.mark.slow
def test_a_registered_volo_final_folder_loads_in_plain_timm(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = create_model("volo_d1", 32, 10, 0.0).eval()
    save_final(tmp_path / "run", model.state_dict(), model_manifest("volo_d1", 32, 10))
    images = torch.randn(1, 3, 32, 32)
    got, _ = timm_logits(tmp_path / "run" / runfiles.FINAL, images, tmp_path)
    assert json.loads((tmp_path / "run/final/config.json").read_text())["architecture"] == (
        "volo_d1_224"
    )
    torch.testing.assert_close(got, vitpod_logits(tmp_path / "run", "volo_d1", images))


def test_volo_tiny_has_no_timm_files_and_the_manifest_says_why(tmp_path: Path) -> None:
    save_final(tmp_path, create_model("volo_tiny", 32, 10, 0.0).state_dict(),
               model_manifest("volo_tiny", 32, 10))  # fmt: skip
    final = tmp_path / runfiles.FINAL
    assert sorted(p.name for p in final.iterdir()) == [runfiles.FINAL_RECORD, runfiles.FINAL_MODEL]
    manifest = json.loads((final / runfiles.FINAL_RECORD).read_text())
    assert manifest["timm"] == {"architecture": None, "why_not": registry.NOT_IN_TIMM}
    # The reason holds: timm's VOLO entry points take no shape of their own.
    with pytest.raises(TypeError, match="multiple values for keyword argument 'layers'"):
        timm.create_model("volo_d1_224", layers=(1, 1), embed_dims=(32, 64), num_heads=(1, 2))


def test_a_final_folder_of_the_previous_release_still_loads_and_is_still_checked(tmp_path):
    """final/ written before model.json existed keeps its record as manifest.json: a fine-tune
    still reads it and still refuses weights that no longer match its sha256."""
    from vitpod.trainer.model.models import read_weights

    state = create_model("volo_tiny", 32, 10, 0.0).state_dict()
    save_final(tmp_path, state, model_manifest("volo_tiny", 32, 10))
    final = tmp_path / runfiles.FINAL
    (final / runfiles.FINAL_RECORD).rename(final / runfiles.MANIFEST)
    loaded, record = read_weights(str(tmp_path))
    assert record["model"] == "volo_tiny" and record["file"] == runfiles.FINAL_MODEL
    assert set(loaded) == set(state)
    data = bytearray((final / runfiles.FINAL_MODEL).read_bytes())
    data[-20] ^= 0xFF
    (final / runfiles.FINAL_MODEL).write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="does not match the sha256 its manifest.json"):
        read_weights(str(tmp_path))


def test_weights_timm_would_not_load_write_no_timm_folder(tmp_path: Path) -> None:
    """A state whose shapes are not the architecture's (here a 16 px vit_micro filed as 32 px):
    no config.json that timm would choke on; model.pt and the manifest (with why) as before."""
    state = create_model("vit_micro", 16, 10, 0.0).state_dict()
    save_final(tmp_path, state, model_manifest("vit_micro", 32, 10))
    final = tmp_path / runfiles.FINAL
    assert not (final / runfiles.TIMM_CONFIG).exists()
    assert not (final / runfiles.TIMM_WEIGHTS).exists()
    why = json.loads((final / runfiles.FINAL_RECORD).read_text())["timm"]["why_not"]
    assert "keys or shapes are not the trained vit_micro's" in why


@pytest.mark.slow
def test_finetune_reads_a_timm_folder_and_checks_its_recorded_sha256(
    trained: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "timm-only"
    shutil.copytree(trained / runfiles.FINAL, folder)
    (folder / runfiles.FINAL_MODEL).unlink()  # what timm or the Hub leaves: safetensors + config
    saved = torch.load(runfiles.final_model(trained), weights_only=True)
    model = create_model("vit_micro", 64, 10, 0.0)
    assert load_finetune(model, str(folder), "vit_micro") == []
    assert torch.equal(model.blocks[0].attn.qkv.weight, saved["blocks.0.attn.qkv.weight"])
    weights = folder / runfiles.TIMM_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="model.safetensors does not match the sha256"):
        load_finetune(create_model("vit_micro", 32, 10, 0.0), str(folder), "vit_micro")


# ---------------------------------------------------------------- what timm's train.py writes


def test_finetune_reads_timms_own_checkpoint_saver_files(tmp_path: Path) -> None:
    """last.pth.tar from timm.utils.CheckpointSaver, as timm's train.py writes it: `state_dict`,
    `state_dict_ema`, its argparse Namespace, the optimizer, version and metric."""
    torch.manual_seed(0)
    small = create_model("volo_tiny", 32, 10, 0.0)
    ema = ModelEmaV3(small)
    args = argparse.Namespace(model="volo_tiny", lr=1e-3, img_size=None, mean=None)
    saver = CheckpointSaver(small, torch.optim.SGD(small.parameters(), lr=0.1), args=args,
                            model_ema=ema, checkpoint_dir=str(tmp_path))  # fmt: skip
    saver.save_checkpoint(epoch=0, metric=1.0)
    saved = torch.load(tmp_path / "last.pth.tar", weights_only=False)
    assert {"state_dict", "state_dict_ema", "args", "optimizer"} <= set(saved)
    assert isinstance(saved["args"], argparse.Namespace)
    big = create_model("volo_tiny", 64, 10, 0.0)
    assert load_finetune(big, str(tmp_path / "last.pth.tar"), "volo_tiny") == []
    assert torch.equal(big.patch_embed.conv[0].weight, small.patch_embed.conv[0].weight)


@pytest.mark.parametrize("prefix", ["model.", "model.backbone."])
def test_keys_under_a_foreign_prefix_get_their_own_message(tmp_path: Path, prefix: str) -> None:
    """A Lightning-style checkpoint: weights under `state_dict`, every key prefixed."""
    state = create_model("volo_tiny", 32, 10, 0.0).state_dict()
    torch.save({"state_dict": {prefix + k: v for k, v in state.items()}, "epoch": 1},
               tmp_path / "lightning.ckpt")  # fmt: skip
    with pytest.raises(ModelLoadError, match=f"every key starts with '{prefix}'") as err:
        load_finetune(create_model("volo_tiny", 32, 10, 0.0), str(tmp_path / "lightning.ckpt"),
                      "volo_tiny")  # fmt: skip
    assert "weights are not a" not in str(err.value)
    assert f"{len(state)} of the {len(state)} keys" in str(err.value)


def test_weights_under_an_unknown_wrapper_are_named(tmp_path: Path) -> None:
    state = create_model("volo_tiny", 32, 10, 0.0).state_dict()
    torch.save({"net": state, "epoch": 1}, tmp_path / "other.pth")
    with pytest.raises(ModelLoadError, match="its tensors are under 'net'"):
        load_finetune(create_model("volo_tiny", 32, 10, 0.0), str(tmp_path / "other.pth"),
                      "volo_tiny")  # fmt: skip


def test_a_wrapper_inside_a_wrapper_is_unwrapped(tmp_path: Path) -> None:
    small = create_model("volo_tiny", 32, 10, 0.0)
    weights = {f"module.{k}": v for k, v in small.state_dict().items()}
    torch.save({"model": {"state_dict": weights}}, tmp_path / "nested.pth")
    big = create_model("volo_tiny", 32, 10, 0.0)
    assert load_finetune(big, str(tmp_path / "nested.pth"), "volo_tiny") == []
    assert torch.equal(big.head.weight, small.head.weight)


def test_what_weights_only_refuses_is_named_not_torchs_page_of_advice(tmp_path: Path) -> None:
    state = create_model("volo_tiny", 32, 10, 0.0).state_dict()
    args = argparse.Namespace(output=Path("/runs/x"))  # a Path inside timm's args Namespace
    torch.save({"state_dict": state, "args": args}, tmp_path / "model_best.pth.tar")
    with pytest.raises(ModelLoadError, match="holds a pathlib.PosixPath, which torch.load"):
        load_finetune(create_model("volo_tiny", 32, 10, 0.0),
                      str(tmp_path / "model_best.pth.tar"), "volo_tiny")  # fmt: skip
