"""Every option of timm's train.py (its own parser, read from the peer copy at test time) is one
of: accepted with timm's meaning, accepted with no effect (recorded), or refused with its own
reason, on the command line and in `-c args.yaml` alike; the docs table is the table's."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from vitpod.trainer.config import ConfigError
from vitpod.trainer.settings import timmoptions, timmvalues
from vitpod.trainer.settings.flags import parse_args
from vitpod.trainer.settings.timmoptions import ACCEPTED, NO_EFFECT, REFUSED, TIMM

REPO = Path(__file__).resolve().parents[1]
PEER = next(
    (p / "shared" / "peers" / "timm_train.py" for p in REPO.parents
     if (p / "shared" / "peers" / "timm_train.py").is_file()),
    REPO.parent / "shared" / "peers" / "timm_train.py",
)  # fmt: skip
TIMM_ARGS = REPO / "tests" / "fixtures" / "timm" / "args.yaml"


def peer_module() -> Any:
    assert PEER.is_file(), f"timm's train.py is expected at {PEER} (../shared/peers)"
    spec = importlib.util.spec_from_file_location("timm_train_peer", PEER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peer() -> Any:
    return peer_module()


def peer_actions(peer: Any) -> list[argparse.Action]:
    return [a for a in peer.parser._actions if not isinstance(a, argparse._HelpAction)]


# Values typed for accepted options whose kind alone makes no valid value, and what they set.
SAMPLES: dict[str, tuple[list[str], Any]] = {
    "data": (["/d"], "/d"), "data_dir": (["/d"], "/d"),
    "dataset": (["torch/cifar10"], "cifar10"), "model": (["vit_tiny_patch16_224"], None),
    "amp_dtype": (["float16"], "fp16"), "opt": (["fusedlamb"], "lamb"),
    "sched": (["step"], "step"), "clip_mode": (["value"], "value"),
    "mixup_mode": (["pair"], "pair"), "interpolation": (["bilinear"], "bilinear"),
    "train_interpolation": (["random"], "random"), "aa": (["rand-m7-mstd0.5"], None),
    "torchcompile": ([], "on"), "input_size": (["3", "96", "96"], (3, 96, 96)),
    "model_kwargs": (["qkv_bias=False", "act=gelu"], {"qkv_bias": False, "act": "gelu"}),
    "opt_kwargs": (["foreach=False"], {"foreach": False}), "output": (["o"], None),
    "experiment": (["e"], "e"), "resume": (["/ck.pt"], None), "model_ema_decay": (["0.99"], None),
    "warmup_epochs": (["3"], None), "channels_last": ([], True),
}  # fmt: skip


def typed(option: timmoptions.TimmOption) -> tuple[list[str], Any]:
    """A value other than timm's default, as tokens, and what it means."""
    if option.key in SAMPLES:
        tokens, meant = SAMPLES[option.key]
        return tokens, option.kind(tokens[0]) if meant is None else meant
    if option.kind is bool:
        return [], True
    count = option.nargs if isinstance(option.nargs, int) else 2 if option.nargs == "+" else 1
    one = {int: "3", float: "0.3", str: "x"}[option.kind]
    if option.nargs == "+" and option.kind is float:
        values = ["0.25", "0.5"]  # increasing: ranges such as --scale
    else:
        values = [one] * count
    meant = [option.kind(v) for v in values]
    return values, tuple(meant) if option.nargs else meant[0]


def outcome(argv: list[str]) -> tuple[str, Any]:
    try:
        return "parsed", parse_args(argv)
    except ConfigError as exc:
        return "refused", str(exc)


def test_the_table_holds_every_timm_option_once_as_timm_spells_it(peer) -> None:
    actions = peer_actions(peer)
    assert len(actions) == len(TIMM) == len(timmoptions.OPTIONS) == 172
    for action in actions:
        option = TIMM[action.dest]
        assert option.flags == tuple(action.option_strings), action.dest
        assert option.default == action.default, action.dest
        nargs = None if action.nargs in (0, None) or option.kind is dict else action.nargs
        assert (option.nargs if option.kind is not dict else None) == nargs, action.dest
        if action.type is not None and option.kind is not dict:
            assert option.kind is action.type, action.dest
        assert option.use in (ACCEPTED, NO_EFFECT, REFUSED)
        assert (option.field is not None) == (option.use == ACCEPTED), action.dest
        assert option.use == ACCEPTED or option.why, f"{action.dest}: no reason given"


def test_every_timm_flag_typed_is_accepted_recorded_or_refused_on_the_command_line(tmp_path):
    """Each of timm's flags with a value other than its default, typed as a user would and
    written into timm's args.yaml for `-c`: never argparse's 'unrecognized arguments'."""
    fixture = yaml.safe_load(TIMM_ARGS.read_text())
    default = parse_args(["/d"])
    for option in timmoptions.OPTIONS:
        tokens, meant = typed(option)
        argv = tokens if not option.flags else ["/d", option.flag, *tokens]
        result, got = outcome(argv)
        file = tmp_path / f"{option.key}.yaml"
        file.write_text(yaml.safe_dump({**fixture, option.key: _as_yaml(option, meant)}))
        from_file, got_file = outcome(["-c", str(file)])
        if option.use == REFUSED:
            for text in (got, got_file):
                assert f"{option.flag}" in str(text) and f"in timm, {option.why}" in str(text), (
                    option.key, text)  # fmt: skip
            assert "unrecognized" not in got
            continue
        assert result == from_file == "parsed", (option.key, got, got_file)
        if option.use == NO_EFFECT:
            assert got.no_effect == {option.flag: option.why} and default.no_effect == {}
            assert got_file.no_effect[option.flag] == option.why
            assert got.requested[option.key] == meant  # args.yaml keeps it, as timm wrote it
            continue
        field = option.field
        if field == "data_dir" or option.key in ("output", "experiment"):
            continue  # the positional DATA and the run directory: tested below
        want = meant
        if option.key == "input_size":
            field, want = "img_size", 96
        value = getattr(got, field)
        assert value == want or value == pytest.approx(want), (option.key, value, want)
        assert getattr(got_file, field) == value, option.key


def _as_yaml(option: timmoptions.TimmOption, meant: Any) -> Any:
    """The value timm's own args.yaml holds for it."""
    if option.key in SAMPLES:
        tokens = SAMPLES[option.key][0]
        if option.kind is dict:
            return dict(timmvalues.kwarg_pair(t) for t in tokens)
        if option.key == "torchcompile":
            return "inductor"
        if option.nargs:
            return [option.kind(t) for t in tokens]
        return option.kind(tokens[0]) if tokens else True
    return list(meant) if isinstance(meant, tuple) else meant


def test_data_dir_and_experiment_mean_what_they_mean_in_timm() -> None:
    assert parse_args(["--data-dir", "/data"]).data_dir == "/data"
    assert parse_args(["/data"]).data_dir == "/data"
    cfg = parse_args(["/d", "--output", "/runs", "--experiment", "e1"])
    assert cfg.output == "/runs/e1" and cfg.experiment == "e1"


def test_a_refusal_says_what_timm_does_why_not_and_what_instead(capsys) -> None:
    from vitpod.trainer.__main__ import main

    assert main(["/d", "--print-config", "--no-aug"]) == 2
    err = capsys.readouterr().err
    assert "--no-aug: in timm, turns every train augmentation off" in err
    assert "--aa '' --reprob 0 --hflip 0" in err and "unrecognized" not in err
    # At timm's default a refused option asks for nothing: accepted as typed.
    assert parse_args(["/d", "--val-split", "validation", "--recount", "1"]).no_effect == {}
    # timm resolves these names to the same DATA/train and DATA/val folders as its defaults
    assert parse_args(["/d", "--val-split", "val", "--train-split", "training"]).no_effect == {}
    assert main(["/d", "--print-config", "--val-split", "test"]) == 2
    assert "--val-split test: in timm, selects the validation split" in capsys.readouterr().err


def test_a_prefix_of_a_timm_flag_names_the_whole_flag() -> None:
    """timm's parser takes a flag's unique prefix (its documented JSD command types --jsd);
    vitpod's names the flag instead of argparse's generic refusal."""
    with pytest.raises(ConfigError) as refused:
        parse_args(["/d", "--jsd", "--grad-accum=2", "--no-such", "--epoch", "3"])
    text = str(refused.value)
    assert "--jsd: timm's train.py reads it as --jsd-loss (a prefix)" in text
    assert "type --grad-accum-steps" in text
    assert "unrecognized arguments: --no-such --epoch 3;" in text  # --epoch: timm's is ambiguous


def test_the_command_line_wins_over_a_refused_key_of_timms_args_yaml(tmp_path: Path) -> None:
    """command line > config file for refused keys too: timm's args.yaml of a CPU run
    (`device: cpu`) or of an AdamW run without lr (sqrt scaling) trains once the command line
    gives timm's default or the lr the refusal asks for; the file alone stays refused."""
    file = tmp_path / "args.yaml"
    fixture = yaml.safe_load(TIMM_ARGS.read_text())
    file.write_text(yaml.safe_dump({**fixture, "device": "cpu", "lr": None, "opt": "adamw",
                                    "lr_base_scale": ""}))  # fmt: skip
    with pytest.raises(ConfigError, match=r"--device cpu: in timm.*lr: None with lr_base_scale"):
        parse_args(["/d", "-c", str(file)])
    cfg = parse_args(["/d", "-c", str(file), "--device", "cuda", "--lr", "1e-3"])
    assert (cfg.lr, cfg.opt, cfg.no_effect) == (1e-3, "adamw", {})
    with pytest.raises(ConfigError, match="--device cpu: in timm"):
        parse_args(["/d", "-c", str(file), "--lr-base-scale", "linear"])


def test_the_docs_flag_table_is_the_tables() -> None:
    done = subprocess.run([sys.executable, "scripts/timm_flags_table.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("hfds/imagenet-1k", "a Hugging Face datasets data set"),
        ("hfids/imagenet-1k", "a Hugging Face data set streamed from the Hub"),
        ("torch/imagenet", "torchvision's ImageNet"),
        ("torch/mnist", "a torchvision data set read (or downloaded) by torchvision's own class"),
        ("tfds/imagenet2012", "a TensorFlow Datasets data set"),
        ("wds/imagenet", "WebDataset tars read as a stream"),
    ],
)
def test_timms_other_dataset_families_are_refused_each_with_its_reason(name, why, tmp_path):
    """timm's dataset names vitpod does not read: their own reason and what to use instead, on
    the command line and in timm's args.yaml, never argparse's 'invalid choice'."""
    file = tmp_path / "args.yaml"
    file.write_text(yaml.safe_dump({**yaml.safe_load(TIMM_ARGS.read_text()), "dataset": name}))
    for argv in (["/d", "--dataset", name], ["-c", str(file)]):
        with pytest.raises(ConfigError) as refused:
            parse_args(argv)
        text = str(refused.value)
        assert f"--dataset {name}: in timm, {why}" in text, text
        assert "--dataset shards" in text and "invalid choice" not in text
    assert parse_args(["/d", "--dataset", "Torch/CIFAR100"]).dataset == "cifar100"
    # A name of no family (or an unknown prefix) is a folder in timm: vitpod says so.
    for other in ("imagenet", "foo/bar"):
        with pytest.raises(ConfigError, match=f"--dataset {other}: in timm, a name of none of "
                           "its families .* give --dataset folder for that"):  # fmt: skip
            parse_args(["/d", "--dataset", other])
