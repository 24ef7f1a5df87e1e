"""timm's everyday flags do what they do in timm: a run with them trains and timm's own train.py
reads its args.yaml back; gradient accumulation is a larger batch; the loss, model, transforms,
schedule, repeated augmentation and pretrained weights each follow the flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file
from torch import nn

from tests.fixtures_data import data_config
from tests.helpers import QUICK
from tests.test_timm_options import peer_module
from vitpod.trainer.__main__ import main
from vitpod.trainer.data import create_loader
from vitpod.trainer.data.sharding import rank_batches, repeated_order
from vitpod.trainer.data.transforms import train_transform
from vitpod.trainer.exitcodes import OK
from vitpod.trainer.model.components import make_criterion
from vitpod.trainer.model.models import (
    ModelLoadError,
    create_model,
    load_finetune,
    pretrained_file,
    sync_batchnorm,
)
from vitpod.trainer.model.optim import create_schedule
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.settings.flags import parse_args

EVERYDAY = [
    "--bce-loss", "--drop", "0.1", "--model-kwargs", "qkv_bias=False", "--color-jitter", "0.3",
    "--ratio", "0.5", "2.0", "--train-interpolation", "random", "--mean", "0.5", "--std", "0.5",
    "-vb", "4", "--aug-repeats", "2", "--clip-grad", "1", "--clip-mode", "value",
    "--cooldown-epochs", "1", "--no-sched-on-updates", "--grad-accum-steps", "2",
    "--checkpoint-hist", "2", "--pin-mem", "--torchcompile",
]  # fmt: skip


def test_a_run_with_timms_everyday_flags_trains_and_timm_reads_its_args_yaml(
    digits_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    argv = [str(digits_dir), *QUICK, *EVERYDAY, "--max-steps", "2", "--output", str(run)]
    with torch.compiler.set_stance("force_eager"):  # --torchcompile is recorded; CPU: eager
        assert main(argv) == OK
    config = json.loads((run / "config.json").read_text())
    assert (config["accum_steps"], config["keep_last"], config["aug_repeats"]) == (2, 2, 2)
    assert (config["bce_loss"], config["drop"], config["model_kwargs"]) == (
        True, 0.1, {"qkv_bias": False})  # fmt: skip
    assert (config["clip_mode"], config["sched_on_updates"], config["cooldown_epochs"]) == (
        "value", False, 1)  # fmt: skip
    assert config["no_effect"] == {"--pin-mem": pytest.approx(config["no_effect"]["--pin-mem"])}
    written = yaml.safe_load((run / "args.yaml").read_text())
    assert written["grad_accum_steps"] == 2 and "accum_steps" not in written
    assert written["torchcompile"] == "inductor" and written["amp_dtype"] == "bfloat16"
    # timm's train.py, its own config loading (-c sets its parser's defaults), on this file.
    peer = peer_module()
    monkeypatch.setattr(sys, "argv", ["train.py", "-c", str(run / "args.yaml")])
    args, _ = peer._parse_args()
    assert (args.grad_accum_steps, args.checkpoint_hist, args.validation_batch_size) == (2, 2, 4)
    assert (args.bce_loss, args.drop, args.model_kwargs) == (True, 0.1, {"qkv_bias": False})
    assert (args.ratio, args.mean, args.train_interpolation) == ([0.5, 2.0], [0.5], "random")
    assert (args.aug_repeats, args.clip_mode, args.cooldown_epochs) == (2, "value", 1)
    assert (args.sched_on_updates, args.pin_mem, args.torchcompile) == (False, True, "inductor")
    assert (args.model, args.img_size, args.data_dir) == ("volo_tiny", 32, str(digits_dir))
    # Settings left unset are written as the run resolved them: timm reads null as its own
    # default (1000 classes, drop path 0, the model's crop), not what vitpod trained.
    assert (args.num_classes, args.drop_path, args.crop_pct) == (
        10, config["drop_path"], config["crop_pct"])  # fmt: skip
    assert config["num_classes"] == 10 and config["drop_path"] and config["crop_pct"]
    assert (args.epochs, args.warmup_epochs, args.amp_dtype) == (1, 0, "bfloat16")
    # timm's main() derives the unset lr from these (lr_base None was a TypeError there, and
    # lr_base_scale '' means sqrt scaling for AdamW): the LR vitpod trained with.
    assert (args.lr, args.lr_base_scale) == (None, "linear")
    global_batch = args.batch_size * args.grad_accum_steps
    assert args.lr_base * global_batch / args.lr_base_size == pytest.approx(config["lr"])
    # ... and vitpod reads the same file back to the same configuration.
    again = parse_args(["-c", str(run / "args.yaml")]).record()
    original = parse_args(argv).record()
    assert {k for k in again if again[k] != original[k]} == {"config", "num_classes"}
    assert again["num_classes"] == config["num_classes"]  # the count the run resolved


def _vit_run(digits_dir: Path, run: Path, batch: list[str]) -> dict[str, torch.Tensor]:
    plain = ["--aa", "", "--reprob", "0", "--hflip", "0", "--scale", "1", "1", "--ratio", "1",
             "1", "--color-jitter", "0", "--drop-path", "0", "--model", "vit_tiny_patch16_224",
             "--opt", "sgd", "--lr", "0.5", "--clip-grad", "0"]  # fmt: skip
    argv = [str(digits_dir), *QUICK, *plain, *batch, "--output", str(run), "--compile", "off"]
    assert main(argv) == OK
    return torch.load(run / "final" / "model.pt", map_location="cpu", weights_only=True)


def test_grad_accum_steps_is_a_larger_batch(digits_dir: Path, tmp_path: Path) -> None:
    """One update of -b 8 x --grad-accum-steps 2 equals one of -b 16: the same 16 samples (the
    sharding cuts by the global batch), the mean of the two halves' gradients (a ViT: no
    BatchNorm, whose statistics would be per micro-batch)."""
    accumulated = _vit_run(digits_dir, tmp_path / "a", ["-b", "8", "--grad-accum-steps", "2"])
    larger = _vit_run(digits_dir, tmp_path / "b", ["-b", "16"])
    start = _vit_run(digits_dir, tmp_path / "c", ["-b", "16", "--lr", "1e-12"])
    moved = max((larger[k] - start[k]).abs().max().item() for k in larger)
    differ = max((accumulated[k] - larger[k]).abs().max().item() for k in larger)
    print(f"one update moved weights by {moved:.3g}; accumulated vs larger batch: {differ:.3g}")
    assert moved > 1e-3 and differ < 1e-4 * moved, (moved, differ)


def test_bce_loss_is_timms_binary_cross_entropy() -> None:
    from timm.loss import BinaryCrossEntropy

    cfg = parse_args(["/d", "--bce-loss", "--bce-target-thresh", "0.2", "--smoothing", "0.3"])
    loss = make_criterion(cfg)
    assert isinstance(loss, BinaryCrossEntropy)
    assert (loss.smoothing, loss.target_threshold) == (0.3, 0.2)
    logits, target = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    dense = torch.full((4, 5), 0.3 / 5)
    dense[torch.arange(4), target] += 0.7
    expected = nn.functional.binary_cross_entropy_with_logits(logits, (dense > 0.2).float())
    assert loss(logits, target).item() == pytest.approx(expected.item())
    with_mixup = make_criterion(parse_args(["/d", "--bce-loss", "--mixup", "0.8"]))
    assert with_mixup.smoothing == 0.0  # Mixup's targets carry the smoothing, as in timm
    assert problems(parse_args(["/d", "--bce-loss", "--token-label"]), for_training=False)


def test_drop_and_model_kwargs_reach_the_constructor() -> None:
    model = create_model("volo_tiny", 32, 10, 0.0, drop=0.25, model_kwargs={"qkv_bias": True})
    assert 0.25 in {m.p for m in model.modules() if isinstance(m, nn.Dropout)}  # not attn_drop
    assert 0.25 not in {m.p for m in create_model("volo_tiny", 32, 10, 0.0).modules()
                        if isinstance(m, nn.Dropout)}  # fmt: skip
    assert all(m.bias is not None for n, m in model.named_modules() if n.endswith(".v"))
    # timm's train.py users size a ViT with --model-kwargs img_size=N (timm passes no --img-size)
    assert create_model("vit_tiny_patch16_224", 32, 10, 0.0, model_kwargs={"img_size": 32})
    with pytest.raises(ModelLoadError, match="img_size=64 with --img-size 32: "):
        create_model("vit_tiny_patch16_224", 32, 10, 0.0, model_kwargs={"img_size": 64})
    with pytest.raises(ModelLoadError, match=r"--model-kwargs \{'no_such': 1\}: .*no_such"):
        create_model("volo_tiny", 32, 10, 0.0, model_kwargs={"no_such": 1})


def test_transform_flags_build_timms_transform(digits_dir: Path) -> None:
    from timm.data.transforms import RandomResizedCropAndInterpolation
    from torchvision.transforms import ColorJitter, Normalize

    cfg = parse_args([str(digits_dir), "--ratio", "0.5", "2", "--train-interpolation", "random",
                      "--color-jitter", "0.3", "--aa", "", "--mean", "0.5", "--std", "0.2",
                      "--input-size", "3", "48", "48"])  # fmt: skip
    from vitpod.trainer.model.components import data_config as from_train_config

    steps = train_transform(from_train_config(cfg)).transforms
    crop = next(s for s in steps if isinstance(s, RandomResizedCropAndInterpolation))
    assert crop.ratio == (0.5, 2.0) and crop.size == (48, 48)
    assert isinstance(crop.interpolation, tuple | list) and len(crop.interpolation) == 2  # random
    jitter = next(s for s in steps if isinstance(s, ColorJitter))
    assert jitter.brightness == (0.7, 1.3)
    norm = next(s for s in steps if isinstance(s, Normalize))
    assert (tuple(norm.mean), tuple(norm.std)) == ((0.5,) * 3, (0.2,) * 3)
    # A random filter is the torch loader's; DALI resizes with --interpolation: refused there.
    found = problems(parse_args([str(digits_dir), "--train-interpolation", "random", "--loader",
                                 "dali"]), for_training=False)  # fmt: skip
    assert any(f.startswith("--train-interpolation random with --loader dali") for f in found)
    # loader auto takes the torch loader for it (without the flag: DALI, which reads no --aa).
    picked = data_config(digits_dir, loader="auto", train_interpolation="random")
    assert type(create_loader(picked, "train", 0, 1)).__name__ == "TorchLoader"
    plain = data_config(digits_dir, loader="auto")
    assert type(create_loader(plain, "train", 0, 1)).__name__ == "DaliLoader"


def test_sched_on_updates_false_steps_per_epoch_and_cooldown_holds_min_lr() -> None:
    from timm.scheduler import create_scheduler_v2

    def lrs(on_updates: bool) -> list[float]:
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
        schedule = create_schedule(optimizer, 6, 1, 0.01, 0.05, 10, on_updates=on_updates,
                                   cooldown_epochs=2)  # fmt: skip
        out = []
        for step in range(80):
            schedule.step_update(num_updates=step)
            out.append(optimizer.param_groups[0]["lr"])
        return out

    per_epoch, per_update = lrs(False), lrs(True)
    reference = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    timm_epochs, total = create_scheduler_v2(
        reference, num_epochs=6, warmup_epochs=1, warmup_lr=0.01, min_lr=0.05, cooldown_epochs=2
    )
    assert total == 8
    for epoch in range(8):  # timm's train.py: one scheduler.step(epoch) per epoch
        timm_epochs.step(epoch)
        expected = reference.param_groups[0]["lr"]
        assert per_epoch[epoch * 10 : epoch * 10 + 10] == [expected] * 10, epoch
    assert per_update[15] != per_update[16]  # per update: the LR moves within an epoch
    assert per_epoch[60:] == per_update[60:] == [0.05] * 20  # the cooldown at --min-lr
    assert parse_args(["/d", "--cooldown-epochs", "3", "--epochs", "7"]).train_epochs == 10


def test_repeated_augmentation_deals_copies_to_ranks_and_resumes_exactly(digits_dir: Path):
    order = repeated_order(1000, seed=3, epoch=2, repeats=3, world_size=4, batch_size=8)
    assert len(order) == 1000 // 256 * 256 // 4 // 8 * 8 * 4  # timm's share per rank
    per_rank = [np.concatenate(rank_batches(order, r, 4, 8, train=True)) for r in range(4)]
    first = order[:12]  # a sample's three copies come in a row before dealing: other ranks
    assert len({int(i) for i in per_rank[0][:8]} & {int(i) for i in per_rank[1][:8]}) >= 2
    assert len(set(first.tolist())) < 12
    assert np.array_equal(order, repeated_order(1000, 3, 2, 3, 4, 8))
    # Through vitpod's loader: a loader rebuilt mid-epoch continues with the same samples.
    cfg = data_config(digits_dir, batch_size=8, aug_repeats=3, return_index=True)
    straight = [i.tolist() for _, _, i in create_loader(cfg, "train", 1, 2)]
    first_loader = create_loader(cfg, "train", 1, 2)
    taken = [i.tolist() for _, (_, _, i) in zip(range(5), first_loader, strict=False)]
    resumed = create_loader(cfg, "train", 1, 2)
    resumed.load_state_dict(first_loader.state_dict())
    rest = [i.tolist() for _, _, i in resumed]
    assert taken + rest == straight
    assert len(straight) * 8 == 1433 // 256 * 256 // 2 // 8 * 8  # the epoch's share
    elastic = parse_args(["/d", "--aug-repeats", "3", "--elastic", "--global-batch", "64"])
    assert any(p.startswith("--aug-repeats with --elastic") for p in problems(elastic, False))


def test_pretrained_reads_a_path_or_the_local_cache_never_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    source = create_model("vit_tiny_patch16_224", 32, 7, 0.0)
    weights = {k: v.contiguous() for k, v in source.state_dict().items()}
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--timm--vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    with pytest.raises(ModelLoadError) as err:
        pretrained_file("vit_tiny_patch16_224", None)
    assert f"not in the local Hugging Face cache {cache}" in str(err.value)
    assert "--pretrained-path FILE" in str(err.value)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    save_file(weights, repo / "snapshots" / "abc" / "model.safetensors")
    found = pretrained_file("vit_tiny_patch16_224", None)
    assert found == str(repo / "snapshots" / "abc" / "model.safetensors")
    assert pretrained_file("vit_tiny_patch16_224", "/my/file") == "/my/file"
    # Loaded as timm's pretrained_path: every tensor but the head (10 classes here, 7 there).
    model = create_model("vit_tiny_patch16_224", 32, 10, 0.0)
    assert sorted(load_finetune(model, found, "vit_tiny_patch16_224")) == [
        "head.bias",
        "head.weight",
    ]
    mine = model.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in weights.items() if not k.startswith("head."))
    assert problems(parse_args(["/d", "--pretrained-path", "/x"]), for_training=False)[0] == (
        "--pretrained-path without --pretrained: timm reads the file only with --pretrained; "
        "add --pretrained (or use --finetune PATH)"
    )


def test_sync_bn_converts_batchnorm_and_is_refused_where_it_cannot_run() -> None:
    model = sync_batchnorm(create_model("volo_tiny", 32, 10, 0.0), torch.device("cpu"), 1)
    assert any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())  # VOLO's stem
    with pytest.raises(ModelLoadError, match="--sync-bn: torch's SyncBatchNorm runs on GPUs"):
        sync_batchnorm(create_model("volo_tiny", 32, 10, 0.0), torch.device("cpu"), 2)
    found = problems(parse_args(["/d", "--sync-bn", "--fsdp"], world_size=2), for_training=False)
    assert any(f.startswith("--sync-bn: DDP (ring/ps) only") for f in found)


@pytest.mark.parametrize("repeats", [1.5, 3])
def test_aug_repeats_deals_the_samples_timms_sampler_deals_fractions_too(
    repeats, digits_dir: Path
) -> None:
    """timm's RepeatAugSampler takes a float (--aug-repeats 1.5: ceil(1.5 N) entries, a sample
    once or twice): each rank reads the samples timm's sampler gives it, under vitpod's seeded
    permutation (timm's with shuffle=False is the identity), and resumes mid-epoch exactly."""
    from timm.data.distributed_sampler import RepeatAugSampler

    from vitpod.trainer.data.sharding import epoch_order

    n, world, batch = 100, 2, 5
    order = repeated_order(n, seed=3, epoch=1, repeats=repeats, world_size=world,
                           batch_size=batch)  # fmt: skip
    position = np.argsort(epoch_order(n, 3, 1, shuffle=True))  # sample -> its place in the perm
    for rank in range(world):
        ours = np.concatenate(rank_batches(order, rank, world, batch, train=True))
        timms = list(RepeatAugSampler(range(n), world, rank, shuffle=False, num_repeats=repeats))
        assert position[ours].tolist() == timms, rank
    assert problems(parse_args(["/d", "--aug-repeats", "1.5"]), False) == []
    cfg = data_config(digits_dir, batch_size=8, aug_repeats=repeats, return_index=True)
    straight = [i.tolist() for _, _, i in create_loader(cfg, "train", 1, 2)]
    first = create_loader(cfg, "train", 1, 2)
    taken = [i.tolist() for _, (_, _, i) in zip(range(5), first, strict=False)]
    resumed = create_loader(cfg, "train", 1, 2)
    resumed.load_state_dict(first.state_dict())
    assert taken + [i.tolist() for _, _, i in resumed] == straight
    assert any(p.startswith("--aug-repeats -1: copies of each image")
               for p in problems(parse_args(["/d", "--aug-repeats", "-1"]), False))  # fmt: skip


def test_timms_documented_folder_layout_train_and_validation_is_read(
    digits_dir: Path, tmp_path: Path
) -> None:
    """DATA/train + DATA/validation (timm's documented layout; its factory also finds val,
    valid, eval, evaluation and training) is read as DATA/train + DATA/val."""
    from vitpod.trainer.data.sources import count_classes, load_split

    root = tmp_path / "data"
    root.mkdir()
    (root / "training").symlink_to(digits_dir / "train")
    (root / "validation").symlink_to(digits_dir / "val")
    cfg = data_config(root)
    for split in ("train", "val"):
        assert len(load_split(cfg, split)) == len(load_split(data_config(digits_dir), split))
    assert count_classes(cfg) == 10
    (root / "validation").rename(root / "eval")
    assert len(load_split(cfg, "val")) == 364
