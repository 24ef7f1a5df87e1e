"""timm's common flags through timm's own factories: --opt (every timm name), --opt-eps/-betas,
--momentum, --sched and its decay flags, --layer-decay; each refused where it cannot work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import QUICK
from vitpod.trainer.__main__ import main
from vitpod.trainer.config import SCHEDULES, ConfigError, TrainConfig
from vitpod.trainer.exitcodes import OK, USAGE
from vitpod.trainer.model.optim import create_optimizer, create_schedule
from vitpod.trainer.settings.checks import opt_problem, problems, valid_optimizers
from vitpod.trainer.settings.flags import parse_args

CPU = torch.device("cpu")


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_every_timm_optimizer_is_accepted_and_steps() -> None:
    names = valid_optimizers()
    assert {"sgd", "lion", "adafactor", "lamb", "adamw", "nadamw"} <= set(names)
    assert not problems(parse_args(["d", "--opt", "lookahead_lion"]), for_training=False)
    for name in names:
        found = [p for p in [opt_problem(name, names)] if p]
        if name == "adahessian":  # timm's train.py runs backward(create_graph=True) for it
            assert found == [f"--opt {name}: a second-order optimizer (its step needs backward("
                             "create_graph=True)), which vitpod's engines do not run; pick "
                             "another --opt"]  # fmt: skip
            continue
        assert not found, name
        if name.startswith(("bnb", "fused")):  # bitsandbytes/apex: CUDA only, refused here
            with pytest.raises(ConfigError, match=f"--opt {name}: .*CUDA GPUs only"):
                create_optimizer(tiny(), name, 1e-2, 0.05, CPU)
            continue
        model = tiny()
        optimizer, _ = create_optimizer(model, name, 1e-2, 0.05, CPU)
        before = [p.detach().clone() for p in model.parameters()]
        # Eager: timm's kron torch.compiles its preconditioner steps, which built C++ kernels
        # for 20 CPU-s on a fresh machine; what is checked here is that each name steps.
        with torch.compiler.set_stance("force_eager"):
            for _ in range(2):  # ADOPT's first step only initialises its moments
                model(torch.randn(4, 8)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        assert any(
            not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
        ), name


def test_an_unknown_optimizer_is_one_error_listing_timms_names(tmp_path, capsys) -> None:
    found = problems(parse_args(["d", "--opt", "adamww"]), for_training=False)
    assert len(found) == 1 and found[0].startswith("--opt adamww: not an optimizer of timm")
    assert "adamw, adamwlegacy" in found[0] and "sgd" in found[0]
    assert main([str(tmp_path), "--opt", "adamww", "--output", str(tmp_path / "r")]) == USAGE
    assert "--opt adamww: not an optimizer of timm" in capsys.readouterr().err


def test_the_default_optimizer_is_timms_and_checking_it_imports_neither_timm_nor_torch() -> None:
    """The planner checks every job's flags: with the default --opt it must not pay timm's and
    torch's imports (some 10 s of CPU a command)."""
    assert TrainConfig.opt in valid_optimizers()
    code = (
        "import sys; from vitpod.trainer.settings.checks import problems; "
        "from vitpod.trainer.settings.flags import parse_args; "
        "print(problems(parse_args(['d']), for_training=False), "
        "sorted({m.split('.')[0] for m in sys.modules} & {'timm', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "[]"], out.stdout + out.stderr


def test_eps_betas_momentum_reach_the_optimizer_and_the_adamw_fast_path_stays() -> None:
    optimizer, impl = create_optimizer(tiny(), "adamw", 1e-3, 0.05, CPU, 1e-6, (0.8, 0.9))
    assert impl == "torch fused" and type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["eps"], group["betas"], group["fused"]) == (1e-6, (0.8, 0.9), True)
    optimizer, impl = create_optimizer(tiny(), "sgd", 0.1, 0.0, CPU, momentum=0.5)
    assert impl == "timm" and optimizer.param_groups[0]["momentum"] == 0.5
    assert optimizer.param_groups[0]["nesterov"]  # timm's sgd is Nesterov's
    cfg = parse_args(["d", "--opt", "lion", "--opt-betas", "0.9", "0.99", "--opt-eps", "1e-7"])
    assert (cfg.opt_betas, cfg.opt_eps, cfg.momentum) == ((0.9, 0.99), 1e-7, 0.9)


def schedule(sched: str, warmup: int = 0, **kwargs):
    optimizer = torch.optim.SGD(tiny().parameters(), lr=1.0)
    return create_schedule(optimizer, 6, warmup, 0.0, 0.0, 10, sched, **kwargs), optimizer


def lr_at(scheduler, optimizer, step: int) -> float:
    scheduler.step_update(num_updates=step)
    return optimizer.param_groups[0]["lr"]


def test_step_and_multistep_decay_per_update_by_epoch_count() -> None:
    step, opt = schedule("step", decay_epochs=2, decay_rate=0.5)  # 10 updates per epoch
    assert [lr_at(step, opt, s) for s in (0, 19, 20, 39, 40)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    multi, opt = schedule("multistep", decay_milestones=(1, 4), decay_rate=0.1)
    assert [lr_at(multi, opt, s) for s in (5, 15, 35, 45)] == pytest.approx([1, 0.1, 0.1, 0.01])


def test_a_loaded_schedule_continues_where_the_saved_one_was() -> None:
    for sched in SCHEDULES:
        straight, opt = schedule(sched, warmup=1)  # rsqrt's timescale is the warmup's
        lrs = [lr_at(straight, opt, s) for s in range(60)]
        saved, opt = schedule(sched, warmup=1)
        lr_at(saved, opt, 23)
        resumed, opt = schedule(sched, warmup=1)
        resumed.load_state_dict(saved.state_dict())
        assert [lr_at(resumed, opt, s) for s in range(23, 60)] == lrs[23:], sched


def test_schedules_that_cannot_step_per_update_are_refused_clearly() -> None:
    (found,) = problems(parse_args(["d", "--sched", "plateau"]), for_training=False)
    assert found.startswith("--sched plateau: timm's plateau lowers the LR when the eval metric")
    # true of both stepping modes: --no-sched-on-updates steps once per epoch, by step count
    assert "per epoch with --no-sched-on-updates" in found and "no metric" in found
    assert "use one of cosine, tanh, step, multistep" in found
    with pytest.raises(ConfigError, match=r"--sched wsd: .*decay_epochs"):
        schedule("wsd", decay_epochs=50)


def test_a_step_schedule_trains_and_logs_its_decayed_lr(digits_dir: Path, tmp_path: Path) -> None:
    import json

    args = [*QUICK, "--max-steps", "3", "--sched", "step", "--decay-epochs", "0.01",
            "--decay-rate", "0.5", "--lr", "0.1", "--opt", "sgd", "--momentum", "0.8"]  # fmt: skip
    assert main([str(digits_dir), *args, "--output", str(tmp_path / "r")]) == OK
    lines = (tmp_path / "r" / "metrics" / "rank0.jsonl").read_text().splitlines()
    lrs = [json.loads(x)["lr"] for x in lines if '"kind": "step"' in x]
    assert lrs[0] == 0.1 and lrs[2] < lrs[1] < lrs[0]  # halved by the update count
