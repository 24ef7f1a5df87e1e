"""Token labels on the DALI and gpu loaders: the pipeline returns each sample's decoded shape,
crop window and flip, and the label maps are cut with them after the loader by the torch
loader's code; training, MixToken and exact resume hold, for vitpod's store and TokenLabeling's
published [2, k, H, W] files alike."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.fixtures_data import data_config
from tests.helpers import last_step, make
from tests.test_published_token_labels import write_published
from tests.test_token_label_sets import labels, teacher_run  # noqa: F401 (fixtures)
from vitpod.trainer.__main__ import main
from vitpod.trainer.config import TrainConfig
from vitpod.trainer.data import create_loader
from vitpod.trainer.data.dali_loader import DaliLoader
from vitpod.trainer.data.draws import draw
from vitpod.trainer.data.gpu_decode import GpuDecodeLoader
from vitpod.trainer.data.token_label import TokenLabelStore
from vitpod.trainer.exitcodes import OK, REQUEUE
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.tokenlabels import label

AUGMENT = {"batch_size": 16, "workers": 1, "seed": 3, "hflip": 0.5, "scale": (0.08, 1.0),
           "token_label": True, "token_label_size": 2}  # fmt: skip


@pytest.fixture(scope="module")
def oblong_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 noise JPEGs, 4 per class of 10, none square (24..64 px a side): a crop box with width
    and height swapped would cut another part of the map."""
    root = tmp_path_factory.mktemp("oblong")
    rng = np.random.default_rng(0)
    for i in range(40):
        width, height = (int(v) for v in rng.integers(24, 65, size=2))
        width += 7 if width == height else 0
        folder = root / "train" / str(i % 10)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def published(oblong_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_published(oblong_dir, tmp_path_factory.mktemp("published") / "tl")


@pytest.fixture(scope="module")
def sharded(oblong_dir: Path, teacher_run: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    """vitpod's store over oblong_dir, 2 shards made the way each labeling rank makes them."""
    out = tmp_path_factory.mktemp("sharded") / "tl"
    for shard in range(2):
        assert label.main([str(oblong_dir), "--teacher", str(teacher_run), "--label-dir", str(out),
                           "--img-size", "32", "--topk", "3", "--shard", str(shard),
                           "--num-shards", "2"]) == 0  # fmt: skip
    return out


@pytest.fixture(params=["vitpod", "published"])
def label_dir(request: pytest.FixtureRequest) -> Path:
    """Over oblong_dir: vitpod's sharded store (k=3, grid 2) or published files (k=5, 6x5)."""
    return request.getfixturevalue("sharded" if request.param == "vitpod" else "published")


@pytest.fixture(scope="module")
def digits_published(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_published(digits_dir, tmp_path_factory.mktemp("digits-published") / "tl")


@pytest.fixture(params=["vitpod", "published"])
def digits_label_dir(request: pytest.FixtureRequest) -> Path:
    """Over the digits: vitpod's store in 3 shards (test_token_label_sets) or published files."""
    return request.getfixturevalue("labels" if request.param == "vitpod" else "digits_published")


def _expected(loader, store, epoch: int, index: int) -> tuple[torch.Tensor, bool]:
    """What the torch loader's cut gives for the window and flip drawn for `index`."""
    cfg, split = loader.cfg, loader.split
    with Image.open(split.files[index]) as img:
        width, height = img.size
    d = draw(cfg.seed, epoch, index, (width, height), scale=cfg.scale, ratio=cfg.ratio,
             hflip=cfg.hflip, layers=0, num_ops=1, reprob=0.0)  # fmt: skip
    (x, y), (w, h) = d.crop_anchor, d.crop_shape
    box = (x / width, y / height, (x + w) / width, (y + h) / height)
    flipped = bool(d.mirror)
    return store.target(split.relpath(index), int(split.labels[index]), box, flipped), flipped


def _check_targets(loader, store, batches: int, atol: float = 1e-6) -> None:
    loader.set_epoch(1)
    flips: set[bool] = set()
    for count, (images, targets) in enumerate(loader, 1):
        assert targets.shape == (len(images), 2 + 4, 10)
        assert targets.device == images.device, "cut where the images are"
        targets = targets.cpu()
        for row, index in enumerate(loader.last_indices.tolist()):
            want, flipped = _expected(loader, store, 1, index)
            flips.add(flipped)
            assert torch.allclose(targets[row], want, atol=atol), (index, flipped)
            assert targets[row, 0].argmax() == loader.split.labels[index]
        if count == batches:
            break
    assert flips == {True, False}, "both flipped and unflipped samples"


def test_dali_targets_are_the_torch_cut_of_the_window_and_flip_it_decoded(
    oblong_dir: Path, label_dir: Path
):
    cfg = data_config(oblong_dir, AUGMENT, loader="dali", token_label_data=str(label_dir))
    loader = create_loader(cfg, "train", 1, 2)
    assert isinstance(loader, DaliLoader) and loader.token_label_info["token_grid"] == [2, 2]
    store = TokenLabelStore.open(cfg, 10, loader.split)
    _check_targets(loader, store, batches=3)
    # The cut depends on the box: another seed draws other windows, other targets.
    other = create_loader(
        data_config(oblong_dir, AUGMENT, loader="dali", seed=4, token_label_data=str(label_dir)),
        "train", 1, 2,
    )  # fmt: skip
    other.set_epoch(1)
    loader.set_epoch(1)
    assert not torch.allclose(next(iter(other))[1], next(iter(loader))[1])


def test_gpu_loader_targets_are_the_torch_cut_of_its_windows(oblong_dir: Path, label_dir: Path):
    """The gpu loader's code on the CPU (libjpeg-turbo): cut on its device after decoding."""
    cfg = data_config(oblong_dir, AUGMENT, loader="gpu", token_label_data=str(label_dir))
    split = create_loader(data_config(oblong_dir), "train", 0, 1).split
    store = TokenLabelStore.open(cfg, 10, split)
    loader = GpuDecodeLoader(split, cfg, 0, 1, True, device=torch.device("cpu"), token_labels=store)
    _check_targets(loader, store, batches=3)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="nvJPEG (DALI's 'mixed' decoder, torchvision's decode_jpeg on cuda) needs a CUDA device",
)
@pytest.mark.parametrize("kind", ["dali", "gpu"])
def test_on_a_gpu_the_maps_are_cut_on_the_device_as_the_torch_loader_cuts_them(
    oblong_dir: Path, published: Path, kind: str
):
    cfg = data_config(oblong_dir, AUGMENT, loader=kind, token_label_data=str(published))
    loader = create_loader(cfg, "train", 1, 2)
    assert loader.name == kind
    _check_targets(loader, TokenLabelStore.open(cfg, 10, loader.split), batches=3, atol=1e-5)


def _batches(loader, epoch: int, count: int, state=None) -> dict[int, tuple]:
    loader.set_epoch(epoch)
    if state is not None:
        loader.load_state_dict(state)
    out: dict[int, tuple] = {}
    for n, (images, targets) in enumerate(loader, 1):
        for row, index in enumerate(loader.last_indices.tolist()):
            out[index] = (images[row].clone(), targets[row].clone())
        if n == count:
            break
    return out


def test_a_dali_loader_rebuilt_mid_epoch_gives_the_same_crops_flips_and_targets(
    oblong_dir: Path, published: Path
):
    """Exact resume (a new loader from the state after 2 batches, as after a requeue) and
    elastic resume (that state read by 1 rank instead of 2): every sample's image and target
    are those of the loaders that never stopped."""
    cfg = data_config(oblong_dir, AUGMENT, batch_size=4, loader="dali",
                      token_label_data=str(published))  # fmt: skip
    straight = _batches(create_loader(cfg, "train", 0, 2), epoch=1, count=5)
    first = create_loader(cfg, "train", 0, 2)
    _batches(first, epoch=1, count=2)
    state = first.state_dict()
    resumed = _batches(create_loader(cfg, "train", 0, 2), epoch=1, count=3, state=state)
    assert len(resumed) == 3 * 4 and set(resumed) <= set(straight)
    for index, (image, target) in resumed.items():
        assert torch.equal(image, straight[index][0]) and torch.equal(target, straight[index][1])
    both = {**straight, **_batches(create_loader(cfg, "train", 1, 2), epoch=1, count=5)}
    alone = _batches(create_loader(cfg, "train", 0, 1), epoch=1, count=6, state=state)
    assert len(alone) == 40 - 2 * 8 and set(alone) <= set(both)
    for index, (image, target) in alone.items():
        assert torch.equal(image, both[index][0]) and torch.equal(target, both[index][1])


TRAIN = ["--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "--workers", "1",
         "--loader", "dali", "--token-label", "--ground-truth", "--resume", "none"]  # fmt: skip


def test_a_dali_run_trains_on_token_labels(
    digits_dir: Path, digits_label_dir: Path, tmp_path: Path
):
    run = tmp_path / "run"
    code = main([str(digits_dir), *TRAIN, "-b", "16", "--max-steps", "3",
                 "--token-label-data", str(digits_label_dir), "--output", str(run)])  # fmt: skip
    assert code == OK
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["token_labels"]["path"] == str(digits_label_dir)
    steps = [json.loads(x) for x in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert all(s["loss"] > 0 for s in steps if s["kind"] == "step")
    assert json.loads((run / "config.json").read_text())["loader"] == "dali"


def _preempt_when(run: Path, step: int, stop: threading.Event) -> None:
    """SIGUSR2 to this process (the trainer in it) once it has logged `step`."""
    while not stop.wait(0.02):
        if (run / "metrics" / "rank0.jsonl").exists() and last_step(run) >= step:
            os.kill(os.getpid(), signal.SIGUSR2)
            return


def test_a_preempted_dali_token_label_run_resumes_bit_for_bit(
    digits_half_dir: Path, tmp_path: Path
):
    """Random crops, flips, MixToken and drop path on; a real SIGUSR2 mid-epoch 1 in the same
    process, then the run again: its final weights are those of the run never stopped."""
    labels_dir = write_published(digits_half_dir, tmp_path / "tl")
    args = [str(digits_half_dir), *TRAIN, "-b", "32", "--epochs", "2", "--warmup-epochs", "1",
            "--drop-path", "0.1", "--hflip", "0.5", "--scale", "0.08", "1", "--seed", "5",
            "--checkpoint-every", "0", "--log-interval", "1", "--aa", "", "--reprob", "0",
            "--token-label-data", str(labels_dir)]  # fmt: skip
    args = [a for a in args if a not in ("--resume", "none")]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        assert main([*args, "--output", str(straight)]) == OK
        done = threading.Event()
        watcher = threading.Thread(target=_preempt_when, args=(stopped, 30, done), daemon=True)
        watcher.start()
        try:
            assert main([*args, "--output", str(stopped)]) == REQUEUE
        finally:
            done.set()
        assert not (stopped / "final").exists()
        assert 30 <= last_step(stopped) < 46
        assert main([*args, "--output", str(stopped)]) == OK
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    a, b = (torch.load(r / "final" / "model.pt", weights_only=True) for r in (straight, stopped))
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not differing, differing[:5]
    summaries = [json.loads((r / "summary.json").read_text()) for r in (straight, stopped)]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 46


def test_render_takes_dali_with_token_labels_and_refuses_the_gpu_loaders_randaugment(
    tmp_path: Path,
):
    """The published VOLO-D5 configuration (token labels, RandAugment) on DALI renders; the gpu
    loader, which has no RandAugment, is refused at render, not when the ranks start."""
    runs = tmp_path / "runs"
    ok = make("render", "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5", "OFFLINE=1",
              "ARGS=--loader dali", runs=runs)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    plan = json.loads((Path(ok.stdout.strip().splitlines()[-1]).parent / "plan.json").read_text())
    assert plan["trainer"]["data"]["loader"] == "dali" and plan["trainer"]["data"]["token_label"]
    refused = make("render", "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5", "OFFLINE=1",
                   "ARGS=--loader gpu", runs=tmp_path / "refused")  # fmt: skip
    assert refused.returncode == 2
    errors = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "--loader gpu with --aa rand-m9" in errors[0], refused.stderr
    assert "--aa ''" in errors[0] and not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        ({"loader": "dali", "token_label": True, "token_label_size": 14}, None),
        ({"loader": "gpu", "token_label": True, "token_label_size": 14, "aa": ""}, None),
        ({"loader": "gpu"}, "--loader gpu with --aa rand-m9-mstd0.5-inc1: the gpu loader has no"),
        ({"loader": "dali", "aa": "augmix-m5-w4"}, "DALI runs RandAugment ('rand-m<M>-n<N>...')"),
        ({"loader": "dali", "dataset": "cifar10"}, "--dataset cifar10 is arrays, not encoded"),
    ],
)
def test_the_planners_checks_refuse_only_what_a_loader_cannot_run(flags: dict, refusal):
    """The trainer's torch-free checks, which the planner runs on the exact argv at render."""
    found = problems(TrainConfig(model="volo_tiny", **flags), for_training=False)
    assert found == [] if refusal is None else (len(found) == 1 and refusal in found[0]), found


def test_published_labels_on_packed_shards_are_refused_by_the_planners_checks(published: Path):
    """Published files are per image of a folder: with --dataset shards the ranks would refuse
    them at start; the planner's check (the same code) refuses them at render."""
    flags = dict(model="volo_tiny", token_label=True, token_label_size=14,
                 token_label_data=str(published), loader="dali")  # fmt: skip
    found = problems(TrainConfig(dataset="shards", **flags), for_training=False)
    assert len(found) == 1 and "published labels are one file per image" in found[0], found
    assert "--dataset folder" in found[0]
    assert problems(TrainConfig(dataset="folder", **flags), for_training=False) == []
    # the digits set is JPEGs in class folders too (the live resume test trains on it)
    assert problems(TrainConfig(dataset="digits", **flags), for_training=False) == []
