"""timm's --layer-decay, --grad-checkpointing, mixup/cutmix, --model-ema, --initial-checkpoint
and pretrained_path through timm's own classes; each refused on an engine that cannot run it,
and a run stopped and resumed with mixup and EMA on equals one never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from tests.helpers import QUICK
from tests.test_trainer_config_files import timm_args
from vitpod.trainer.__main__ import main
from vitpod.trainer.checkpointing.rng import reseed_for_step
from vitpod.trainer.config import ConfigError
from vitpod.trainer.exitcodes import OK
from vitpod.trainer.model.components import make_mixup
from vitpod.trainer.model.ema import ema_weights
from vitpod.trainer.model.models import (
    ModelLoadError,
    create_model,
    load_initial_checkpoint,
    set_grad_checkpointing,
)
from vitpod.trainer.model.optim import create_optimizer, create_schedule
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.settings.flags import parse_args

CPU = torch.device("cpu")


def refused(*argv: str) -> list[str]:
    return problems(parse_args(["d", *argv]), for_training=False)


def test_layer_decay_scales_each_layer_by_timms_group_matcher() -> None:
    model = create_model("vit_micro", 32, 10, 0.0)
    optimizer, _ = create_optimizer(model, "adamw", 1.0, 0.05, CPU, layer_decay=0.5)
    scales = sorted({g["lr_scale"] for g in optimizer.param_groups})
    assert scales == [0.5**k for k in range(5, -1, -1)]  # embeddings, 4 blocks, head
    create_schedule(optimizer, 2, 0, 0.0, 0.0, 10).step_update(num_updates=0)
    assert {g["lr"] for g in optimizer.param_groups} == set(scales)
    with pytest.raises(ConfigError, match=r"--layer-decay 0.5: Sequential has no group_matcher"):
        create_optimizer(nn.Sequential(nn.Linear(2, 2)), "adamw", 1.0, 0.05, CPU, layer_decay=0.5)
    assert refused("--layer-decay", "0.7", "--fsdp")[0].startswith("--layer-decay: DDP")


def test_grad_checkpointing_recomputes_the_same_gradients_and_is_refused_with_pp() -> None:
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model = create_model("vit_micro", 32, 10, 0.0)
        if on:
            set_grad_checkpointing(model, "vit_micro")
            assert model.grad_checkpointing
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b) for a, b in zip(*grads, strict=True))
    with pytest.raises(ModelLoadError, match="--grad-checkpointing: --model x has no"):
        set_grad_checkpointing(nn.Linear(2, 2), "x")
    found = refused("--model", "vit_micro", "--grad-checkpointing", "--pp", "2", "-b", "4")
    assert any(f.startswith("--grad-checkpointing with --pp: pipeline stages") for f in found)


def test_mixup_is_a_function_of_the_step_and_refused_with_token_labels() -> None:
    cfg = parse_args(["d", "--mixup", "0.8", "--cutmix", "1.0", "--num-classes", "10"])
    mixup = make_mixup(cfg)
    images, targets = torch.randn(4, 3, 8, 8), torch.arange(4)

    def mixed(step: int) -> torch.Tensor:
        reseed_for_step(5, 0, step, 0)
        return mixup(images.clone(), targets.clone())[1]

    assert torch.equal(mixed(3), mixed(3)) and not torch.equal(mixed(3), mixed(4))
    assert mixed(3).shape == (4, 10)  # soft targets, smoothing 0.1 folded in
    assert make_mixup(parse_args(["d", "--num-classes", "10"])) is None
    (found,) = refused("--mixup", "0.8", "--token-label")
    assert found.startswith("--mixup/--cutmix with --token-label: token labeling mixes")
    assert refused("--cutmix", "1", "-b", "7") == [
        "--mixup/--cutmix: -b 7 is odd (timm's Mixup pairs the batch with its flip); pass an "
        "even -b"
    ]


def test_ema_is_refused_on_engines_that_shard_the_weights() -> None:
    for engine in (["--fsdp"], ["--deepspeed"], ["--model", "vit_micro", "--tp", "2"]):
        found = refused("--model-ema", *engine)
        assert any(f.startswith("--model-ema: DDP (ring/ps) only") for f in found), engine


def test_initial_checkpoint_loads_this_exact_model_or_refuses(tmp_path: Path) -> None:
    source = create_model("vit_micro", 32, 10, 0.0)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "w.pth")  # timm's wrapper
    model = create_model("vit_micro", 32, 10, 0.0)
    load_initial_checkpoint(model, str(tmp_path / "w.pth"), "vit_micro")
    loaded, saved = model.state_dict(), source.state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    with pytest.raises(ModelLoadError, match="--initial-checkpoint .*another image size or class"):
        load_initial_checkpoint(create_model("vit_micro", 32, 7, 0.0), str(tmp_path / "w.pth"),
                                "vit_micro")  # fmt: skip
    both = refused("--initial-checkpoint", "a", "--finetune", "b")
    assert "--initial-checkpoint and --finetune both load the weights; drop one" in both


def test_timms_args_yaml_keys_map_to_the_new_flags(tmp_path: Path) -> None:
    path = timm_args(tmp_path, mixup=0.8, cutmix=1.0, mixup_mode="pair", model_ema=True,
                     model_ema_decay=0.99, grad_checkpointing=True, initial_checkpoint="",
                     pretrained=True, pretrained_path="/w/model.pth")  # fmt: skip
    cfg = parse_args(["-c", str(path)])
    assert (cfg.mixup, cfg.cutmix, cfg.mixup_mode) == (0.8, 1.0, "pair")
    assert (cfg.model_ema, cfg.model_ema_decay, cfg.grad_checkpointing) == (True, 0.99, True)
    assert (cfg.pretrained, cfg.pretrained_path, cfg.initial_checkpoint) == (
        True, "/w/model.pth", None)  # fmt: skip
    # Without a path, --pretrained reads the local Hugging Face cache at run time (never the
    # network): tests/test_timm_everyday.py.
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**data, "pretrained_path": None}))
    assert parse_args(["-c", str(path)]).pretrained_path is None


RUN = [*QUICK, "--mixup", "0.8", "--cutmix", "1.0", "--model-ema", "--model-ema-decay", "0.5",
       "--grad-checkpointing", "--opt", "lamb", "--checkpoint-every", "2"]  # fmt: skip


def test_a_resumed_run_with_mixup_and_ema_equals_an_uninterrupted_one(digits_dir, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    data = str(digits_dir)
    assert main([data, *RUN, "--max-steps", "4", "--output", str(straight)]) == OK
    assert main([data, *RUN, "--max-steps", "2", "--output", str(stopped)]) == OK
    assert main([data, *RUN, "--max-steps", "4", "--output", str(stopped)]) == OK

    def final(run: Path) -> dict[str, torch.Tensor]:
        return torch.load(run / "final" / "model.pt", weights_only=True)

    for weights in (final, ema_weights):
        a, b = weights(straight), weights(stopped)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model, ema = final(straight), ema_weights(straight)
    assert any(not torch.equal(model[k], ema[k]) for k in model)  # an average, not a copy
