"""Flags, YAML and --print-config: the published VOLO-D5 commands, LR scaling and bad input."""

import json
import logging
import shlex

import pytest
import torch

from vitpod.trainer.__main__ import main
from vitpod.trainer.config import ConfigError
from vitpod.trainer.exitcodes import OK, REQUEUE, USAGE
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.settings.flags import parse_args

PRETRAIN = """/path/to/imagenet --model volo_d5 --img-size 224 -b 44 --lr 1.0e-4
  --drop-path 0.75 --apex-amp --token-label --token-label-size 14
  --token-label-data /path/to/token_label_data"""
FINETUNE = """/path/to/imagenet --model volo_d5 --img-size 512 -b 4 --lr 2.3e-5
  --drop-path 0.5 --apex-amp --epochs 30 --weight-decay 1.0e-8 --warmup-epochs 5 --ground-truth
  --token-label --token-label-size 24 --token-label-data /path/to/token_label_data
  --finetune /path/to/pretrained_224_volo_d5/"""


def printed(capsys, command: str) -> tuple[int, dict, str]:
    code = main(["--print-config", *shlex.split(command)])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_exit_codes_are_the_launcher_contract() -> None:
    assert (OK, USAGE, REQUEUE) == (0, 2, 75)


def test_published_pretrain_command_means_what_it_says(capsys) -> None:
    code, cfg, err = printed(capsys, PRETRAIN)
    assert code == OK and err == ""
    assert (cfg["model"], cfg["img_size"], cfg["batch_size"], cfg["lr"]) == (
        "volo_d5",
        224,
        44,
        1e-4,
    )
    assert (cfg["drop_path"], cfg["amp"], cfg["apex_amp"], cfg["amp_dtype"]) == (
        0.75,
        True,
        True,
        "bf16",
    )
    assert (cfg["token_label"], cfg["token_label_size"]) == (True, 14)
    assert cfg["token_label_data"] == "/path/to/token_label_data"
    # Unstated values are VOLO's defaults (300 epochs, 20 warm-up, weight decay 0.05, crop 1.15).
    assert (cfg["epochs"], cfg["warmup_epochs"], cfg["weight_decay"], cfg["crop_pct"]) == (
        300, 20, 0.05, 1.15,
    )  # fmt: skip


def test_published_finetune_command_shows_its_values_and_its_token_label_mistake(capsys) -> None:
    code, cfg, err = printed(capsys, FINETUNE)
    assert code == OK
    assert (cfg["model"], cfg["img_size"], cfg["batch_size"], cfg["lr"]) == (
        "volo_d5",
        512,
        4,
        2.3e-5,
    )
    assert (cfg["drop_path"], cfg["epochs"], cfg["weight_decay"], cfg["warmup_epochs"]) == (
        0.5, 30, 1e-8, 5,
    )  # fmt: skip
    assert cfg["ground_truth"] and cfg["finetune"] == "/path/to/pretrained_224_volo_d5/"
    assert cfg["token_label_size"] == 24
    # 512 / 16 = 32 tokens a side: printing works, training would refuse with the fix named.
    assert "--token-label-size 24 does not match --img-size 512 / 16 = 32" in err
    assert "pass --token-label-size 32" in err


def test_lr_scales_with_global_batch_unless_given() -> None:
    cfg = parse_args(["d", "--model", "volo_d1", "-b", "64", "--accum-steps", "2"], world_size=8)
    assert cfg.global_batch_size == 1024 and cfg.lr == pytest.approx(1.6e-3)  # d1 recipe LRbase
    cfg = parse_args(["d", "--lr-base", "1e-3", "-b", "32"], world_size=4)
    assert cfg.lr == pytest.approx(1e-3 * 128 / 1024)
    assert parse_args(["d", "--lr", "5e-4", "-b", "32"], world_size=4).lr == 5e-4


def test_global_batch_sets_per_rank_batch_or_refuses_to_split(capsys, monkeypatch) -> None:
    assert parse_args(["d", "--global-batch", "96"], world_size=3).batch_size == 32
    with pytest.raises(ConfigError, match=r"--global-batch 100 does not divide over 3 dp rank"):
        parse_args(["d", "--global-batch", "100"], world_size=3)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["/tmp", "--global-batch", "100"]) == USAGE
    assert "pick a multiple of 3" in capsys.readouterr().err


def test_yaml_config_is_read_flags_win_and_unknown_keys_list_valid_ones(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: volo_d2\nbatch-size: 8\nepochs: 7\n")
    cfg = parse_args(["d", "--config", str(path), "--epochs", "9"])
    assert (cfg.model, cfg.batch_size, cfg.epochs, cfg.drop_path) == ("volo_d2", 8, 9, 0.2)
    path.write_text("modle: volo_d2\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown key\(s\) 'modle' \(did you mean 'model'\?\); valid keys: .*'model'",
    ):
        parse_args(["d", "--config", str(path)])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["/no/such/imagenet"], "DATA_DIR /no/such/imagenet: no such directory"),
        ([], "DATA_DIR missing"),
        (["{tmp}", "--token-label", "--token-label-data", "{tmp}", "--token-label-size", "16"],
         "--token-label-size 16 does not match --img-size 224 / 16 = 14"),
        (["{tmp}", "--model", "volo_d9"], "--model volo_d9: unknown"),
        (["{tmp}", "--deepspeed", "--exchange", "ps"], "drop one"),
        (["{tmp}", "--finetune", "/no/such/run"], "--finetune /no/such/run: no such path"),
        (["{tmp}", "--img-size", "100"], "--img-size 100: must be a positive multiple of 16"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_error_before_training(argv, message, tmp_path, capsys) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv, "--output", str(tmp_path / "run")]) == USAGE
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written


def test_finetune_from_another_architecture_is_refused_by_its_manifest(tmp_path, capsys) -> None:
    final = tmp_path / "pre" / "final"
    final.mkdir(parents=True)
    (final / "manifest.json").write_text(json.dumps({"model": "volo_d1"}))
    argv = [str(tmp_path), "--model", "volo_d5", "--finetune", str(tmp_path / "pre")]
    assert main([*argv, "--output", str(tmp_path / "run")]) == USAGE
    assert "checkpoint is a volo_d1, not --model volo_d5" in capsys.readouterr().err


def test_print_config_does_not_need_the_data(capsys) -> None:
    code, cfg, _ = printed(capsys, "/nowhere --model volo_tiny --img-size 32")
    assert code == OK and cfg["data_dir"] == "/nowhere"
    assert problems(parse_args(["/nowhere"]), for_training=True)


def test_apex_amp_means_torch_amp_and_says_so_once(caplog) -> None:
    from vitpod.trainer.speed.precision import make_precision

    with caplog.at_level(logging.INFO):
        precision = make_precision(torch.device("cpu"), False, True, "bf16", None)
    assert precision.dtype is torch.bfloat16 and precision.scaler is None
    assert sum("apex.amp no longer exists" in r.message for r in caplog.records) == 1
    fp16 = make_precision(torch.device("cpu"), True, False, "fp16", None)
    assert fp16.dtype is torch.float16 and fp16.scaler is not None
    assert fp16.channels_last  # NHWC by default: it paid off on the CPU too (oneDNN)
    assert not make_precision(torch.device("cpu"), True, False, "bf16", False).channels_last


def test_attention_kernel_rule_and_override():
    from vitpod.registry import models
    from vitpod.trainer.speed.attention import attention_modules, auto_kernel, choose_kernel

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert auto_kernel(cpu, torch.bfloat16) == "math" and auto_kernel(cpu, None) == "fused"
    assert auto_kernel(gpu, torch.bfloat16) == "fused"
    model = models.build("vit_micro", 32, 10, 0.0)
    assert choose_kernel(model, "auto", cpu, torch.bfloat16) == "math"
    assert not any(m.fused_attn for m in attention_modules(model))
    assert choose_kernel(model, "fused", cpu, torch.bfloat16) == "fused"
    assert all(m.fused_attn for m in attention_modules(model)) and attention_modules(model)
