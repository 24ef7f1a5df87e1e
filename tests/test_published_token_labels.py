"""TokenLabeling's published token labels (`<class>/<image stem>.pt`, [2, k, H, W]) read as
published, and any timm classifier (CNNs included) as a labeling teacher that can write them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from torchvision.ops import roi_align

from vitpod.registry import labellayout, labelset
from vitpod.trainer.__main__ import main
from vitpod.trainer.data import DataConfig
from vitpod.trainer.data.published_labels import PublishedLabelStore
from vitpod.trainer.data.sources import folder_split
from vitpod.trainer.data.token_label import TokenLabelError, TokenLabelStore
from vitpod.trainer.data.torch_loader import SplitDataset
from vitpod.trainer.data.transforms import BoxedTrainTransform
from vitpod.trainer.tokenlabels import label
from vitpod.trainer.tokenlabels.token_forward import dense_logits

CLASSES = 10
GRID = (6, 5)  # not the model's 2x2 (volo_tiny at 32 px), not even square


def write_published(data_dir: Path, root: Path, grid: tuple[int, int] = GRID, k: int = 5) -> Path:
    """An independent writer, as TokenLabeling's generate_label.py saves a label: one file per
    training image, torch.stack([top-k logits, top-k indices]).half(), [2, k, H, W]."""
    gen = torch.Generator().manual_seed(0)
    for image in sorted((data_dir / "train").glob("*/*.jpg")):
        logits = torch.randn(CLASSES, *grid, generator=gen) * 3
        logits[int(image.parent.name)] += 4.0  # the true class usually on top
        value, index = logits.permute(1, 2, 0).topk(k)  # [H, W, k], as the generator's output
        out = root / image.parent.name / (image.name.split(".")[0] + ".pt")
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(torch.stack([value.half(), index.half()]).permute(0, 3, 1, 2), out)
    return root


@pytest.fixture(scope="module")
def published(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_published(digits_dir, tmp_path_factory.mktemp("labels") / "token_label_data")


def _label_config(digits_dir: Path, labels: Path) -> DataConfig:
    return DataConfig(
        data_dir=str(digits_dir), img_size=32, batch_size=16, workers=0, token_label=True,
        token_label_data=str(labels), token_label_size=2,
    )  # fmt: skip


def test_published_layout_is_detected_and_described_without_torch(published: Path):
    assert labellayout.layout_of(published) == labelset.PUBLISHED
    assert labellayout.describe(published) == {
        "layout": "published", "grid": [6, 5], "k": 5, "teacher": None,
    }  # fmt: skip
    legacy = published.parent / "legacy.pt"
    torch.save(torch.zeros(2, 3, 18, 18).half(), legacy, _use_new_zipfile_serialization=False)
    assert labellayout.tensor_file_shape(legacy) == ((2, 3, 18, 18), "Half")


def test_a_token_labeled_run_trains_to_completion_on_published_labels(
    digits_dir: Path, published: Path, tmp_path: Path
):
    run = tmp_path / "run"
    code = main(
        [str(digits_dir), "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32",
         "-b", "16", "--workers", "2", "--loader", "torch", "--max-steps", "3",
         "--token-label", "--token-label-data", str(published), "--ground-truth",
         "--output", str(run), "--resume", "none"]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["token_labels"] == {
        "layout": "published", "path": str(published), "grid": [6, 5], "k": 5,
        "token_grid": [2, 2],
    }  # fmt: skip
    steps = [json.loads(x) for x in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert all(s["loss"] > 0 for s in steps if s["kind"] == "step")


def test_a_crops_label_map_is_the_crop_of_the_images_map(digits_dir: Path, tmp_path: Path):
    """A map whose top class encodes its cell; a box on cell edges (one or two cells per token):
    the token targets are the softmax of the mean of those cells' scattered logits, flipped."""
    height, width, k = 8, 4, 2
    cell = torch.arange(height * width).reshape(height, width)
    values = torch.stack([5.0 + cell / 8, 1.0 + 0 * cell])  # [k, H, W]: distinct per cell
    indices = torch.stack([cell % CLASSES, (cell + 1) % CLASSES])
    root = tmp_path / "labels"
    write_published(digits_dir, root, grid=(height, width), k=k)
    image = "train/3/" + sorted(p.name for p in (digits_dir / "train" / "3").iterdir())[0]
    torch.save(torch.stack([values, indices.float()]).half(), labellayout.label_file(root, image))
    store = TokenLabelStore.open(
        _label_config(digits_dir, root), CLASSES, folder_split(digits_dir, "train")
    )
    assert isinstance(store, PublishedLabelStore) and store.grid == (8, 4) and store.k == 2

    dense = torch.zeros(CLASSES, height, width)
    half = values.half().float()
    for y in range(height):
        for x in range(width):
            for j in range(k):
                dense[indices[j, y, x], y, x] = half[j, y, x]
    # box x in [0, 0.5) -> cells 0..1 (one per token), y in [0.5, 1) -> cells 4..7 (two per token)
    expected = dense[:, 4:8, 0:2].reshape(CLASSES, 2, 2, 2).mean(2)  # [C, 2 rows, 2 cols]
    box = (0.0, 0.5, 0.5, 1.0)
    for flipped in (False, True):
        want = (expected.flip(-1) if flipped else expected).flatten(1).T.softmax(1)
        got = store.target(image, 3, box, flipped)
        assert got.shape == (2 + 4, CLASSES)
        assert torch.allclose(got[2:], want, atol=1e-5), f"flipped={flipped}"
        assert torch.allclose(got[1], want.mean(0), atol=1e-5) and got[0, 3] == 1.0
    assert not torch.allclose(
        store.target(image, 3, box, True)[2:], store.target(image, 3, box, False)[2:]
    )


def test_each_sample_is_cut_with_its_own_crop_box(digits_dir: Path, published: Path):
    """The loader's target is the store's crop for the box and flip the image got (same seed)."""
    cfg = _label_config(digits_dir, published)
    split = folder_split(digits_dir, "train")
    store = TokenLabelStore.open(cfg, CLASSES, split)
    transform = BoxedTrainTransform(cfg)
    dataset = SplitDataset(split, transform, "fail", store)
    seen = set()
    for index, seed in ((0, 1), (700, 2), (1400, 3), (5, 4)):
        _, _, target = dataset[(index, seed)]
        random.seed(seed)
        with Image.open(split.files[index]) as img:
            _, box, flipped = transform(img.convert("RGB"))
        seen.add(flipped)
        want = store.target(split.relpath(index), int(split.labels[index]), box, flipped)
        assert torch.equal(target, want)
        whole = roi_align(
            store.dense(split.relpath(index))[None],
            torch.tensor([[0.0, 0.0, 0.0, 5.0, 6.0]]),
            2,
            aligned=True,
        )[0]
        assert not torch.allclose(target[2:], whole.flatten(1).T.softmax(1)), "a crop, not all"
    assert seen == {True, False}, "both a flipped and an unflipped draw"


def test_published_labels_that_do_not_fit_are_named(digits_dir: Path, tmp_path: Path):
    root = write_published(digits_dir, tmp_path / "labels", grid=(3, 3))
    where = "token-label data 'x'"
    assert labellayout.published_problems(root, where=where, data_dir=str(digits_dir)) == []
    victim = sorted((root / "7").iterdir())[0]
    torch.save(torch.zeros(5, 3, 3).half(), victim)
    found = labellayout.published_problems(root, where=where, data_dir=str(digits_dir), sample=10)
    assert len(found) == 1 and "shape [5, 3, 3], not [2, k, H, W]" in found[0]
    victim.unlink()
    with pytest.raises(TokenLabelError, match=r"no label file for 1 of 1433 images"):
        TokenLabelStore.open(
            _label_config(digits_dir, root), CLASSES, folder_split(digits_dir, "train")
        )
    for file in (root / "4").iterdir():
        file.unlink()
    (root / "4").rmdir()
    found = labellayout.published_problems(root, where=where, data_dir=str(digits_dir))
    assert len(found) == 1 and "no class folder for 1 of the 10 classes" in found[0]
    assert "'4'" in found[0] and "--layout published" in found[0]


def test_a_cnn_teacher_labels_with_its_classifier_at_every_location():
    """ResNet and NFNet: forward_features, then the classifier as a 1x1 convolution; pooling is
    linear, so the locations' mean is the model's own logits."""
    torch.manual_seed(0)
    images = torch.randn(2, 3, 64, 64)
    for name in ("resnet18", "dm_nfnet_f0"):
        model = timm.create_model(name, pretrained=False, num_classes=CLASSES).eval()
        with torch.no_grad():
            dense = dense_logits(model, images)
            features = model.forward_features(images)
        fc = model.get_classifier()
        conv = torch.nn.functional.conv2d(features, fc.weight[:, :, None, None], fc.bias)
        assert dense.shape == (2, CLASSES, 2, 2)
        assert torch.allclose(dense, conv, atol=1e-4), name
        assert torch.allclose(dense.mean((2, 3)), model(images), atol=1e-4), name


def test_the_labeler_writes_the_published_layout_with_a_cnn_teacher(
    digits_dir: Path, tmp_path: Path
):
    torch.manual_seed(0)
    teacher = timm.create_model("resnet18", pretrained=False, num_classes=CLASSES).eval()
    weights = tmp_path / "resnet18.pt"
    torch.save(teacher.state_dict(), weights)
    out = tmp_path / "labels"
    args = [str(digits_dir), "--teacher", str(weights), "--teacher-model", "resnet18",
            "--label-dir", str(out), "--img-size", "64", "-b", "32", "--shard", "0",
            "--num-shards", "20"]  # fmt: skip
    assert label.main(args) == label.USAGE, "vitpod's store needs grid img_size/16"
    assert label.main([*args, "--layout", "published"]) == label.OK
    split = folder_split(digits_dir, "train")
    names = [split.relpath(i) for i in range(71)]  # shard 0 of 20 of 1433 images: 0..70
    for name in (names[0], names[-1]):
        maps = torch.load(labellayout.label_file(out, name), weights_only=True)
        assert maps.shape == (2, 5, 2, 2) and maps.dtype == torch.float16
    assert not labellayout.label_file(out, split.relpath(71)).exists(), "another shard's image"
    sidecar = json.loads(labelset.shard_path(out, 0, 20).with_suffix(".json").read_text())
    assert sidecar["layout"] == "published" and sidecar["teacher_grid"] == [2, 2]


def test_preflight_accepts_the_published_layout_without_a_manifest(
    digits_dir: Path, published: Path, tmp_path: Path
):
    """The login node's check (workflows/planning/preflight.py), torch-free: class folders and a
    sample of [2, k, H, W] files; a foreign file is named with its shape."""
    from types import SimpleNamespace

    from vitpod.workflows.planning import preflight
    from vitpod.workflows.planning.recipe import load_recipe
    from vitpod.workflows.site.profile import load_profile

    def plan(labels: Path) -> SimpleNamespace:
        profile = load_profile("local")
        spec = SimpleNamespace(profile=profile, model="volo_d1", stage="pretrain")
        trainer = {"token_label": True, "token_label_data": str(labels),
                   "data_dir": str(digits_dir), "img_size": 32}  # fmt: skip
        return SimpleNamespace(trainer=trainer, spec=spec, profile=profile,
                               recipe=load_recipe("volo_d1"))  # fmt: skip

    assert preflight.token_label_problems(plan(published)) == []  # type: ignore[arg-type]
    bad = write_published(digits_dir, tmp_path / "bad", grid=(2, 2))
    torch.save({"scores": torch.zeros(2, 5, 2, 2)}, sorted((bad / "0").iterdir())[0])
    found = preflight.token_label_problems(plan(bad))  # type: ignore[arg-type]
    assert len(found) == 1 and "holds a dict, not one tensor" in found[0]
