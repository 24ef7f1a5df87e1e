"""fp16 with dynamic loss scaling through the project's own precision and DDP engine (CPU, and
on a CUDA GPU with NCCL where one is present: benchmarks/gpu_check.sh runs this file there):
a step whose gradients hold inf or NaN is skipped (parameters and optimizer state unchanged)
and the scale halves; a finite step updates. bf16 is refused on a GPU without it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import free_port
from vitpod.registry import gpus
from vitpod.trainer.hardware import bf16_problem


def _fp16_steps(port: int, out: dict, device_type: str) -> None:
    from vitpod.trainer import dist as tdist
    from vitpod.trainer.engines.ddp_engine import DDPEngine
    from vitpod.trainer.speed.precision import make_precision

    device = tdist.init(tdist.DistEnv(0, 0, 1, "127.0.0.1", port, "torchrun"))
    try:
        assert device.type == device_type, device  # the rank's device follows torch's view
        precision = make_precision(device, True, False, "fp16", False)
        out["scaler"] = type(precision.scaler).__name__ if precision.scaler else None
        out["dtype"] = str(precision.dtype)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = DDPEngine(model, optimizer, precision, "ring", 1, 1, clip_grad=1.0)
        images = torch.randn(6, 8, device=device)
        targets = torch.randint(0, 4, (6,), device=device)

        def step(poison: float | None) -> None:
            with precision.autocast():
                logits = engine.forward(images)
                out["autocast_dtype"] = str(logits.dtype)
                loss = torch.nn.functional.cross_entropy(logits, targets)
            engine.backward(loss)
            if poison is not None:
                next(model.parameters()).grad[0, 0] = poison  # type: ignore[index]
            engine.step()

        def snapshot() -> list[torch.Tensor]:
            return [p.detach().clone() for p in model.parameters()]

        assert precision.scaler is not None
        scales = [precision.scaler.get_scale()]
        before = snapshot()
        step(None)
        scales.append(precision.scaler.get_scale())
        out["finite_changed"] = any(
            not torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True)
        )
        state_steps = [float(s["step"]) for s in optimizer.state.values()]
        for name, poison in (("inf", float("inf")), ("nan", float("nan"))):
            before = snapshot()
            step(poison)
            scales.append(precision.scaler.get_scale())
            out[f"{name}_unchanged"] = all(
                torch.equal(a, b) for a, b in zip(before, snapshot(), strict=True)
            )
            out[f"{name}_state_steps"] = [float(s["step"]) for s in optimizer.state.values()]
        out["state_steps"] = state_steps
        out["scales"] = scales
    finally:
        tdist.teardown()


@pytest.mark.parametrize(
    "device_type",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)  # fmt: skip
def test_fp16_step_with_inf_or_nan_gradient_is_skipped_and_the_scale_drops(
    device_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if device_type == "cpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out: dict = {}
    _fp16_steps(free_port(), out, device_type)  # one rank (gloo or NCCL), torn down after
    assert (out["scaler"], out["dtype"], out["autocast_dtype"]) == (
        "GradScaler", "torch.float16", "torch.float16",
    )  # fmt: skip
    assert out["finite_changed"], "a finite fp16 step must update the parameters"
    assert out["inf_unchanged"] and out["nan_unchanged"], "an inf/NaN step must be skipped"
    # AdamW's step count did not advance on the skipped steps.
    assert out["inf_state_steps"] == out["state_steps"] == out["nan_state_steps"]
    initial, after_finite, after_inf, after_nan = out["scales"]
    assert after_finite == initial  # growth only after 2000 clean steps
    assert after_inf == initial / 2 and after_nan == initial / 4


def test_bf16_is_refused_on_a_gpu_before_compute_capability_8() -> None:
    cuda = torch.device("cuda", 0)
    problem = bf16_problem(cuda, capability=(7, 0))
    assert "compute capability 7.0" in problem and "use --amp-dtype fp16" in problem
    assert bf16_problem(cuda, capability=(8, 0)) == ""
    assert bf16_problem(torch.device("cpu")) == ""


def test_the_gpu_table_says_bf16_from_ampere_on() -> None:
    assert gpus.amp_dtype_for(gpus.capability_of("V100-SXM3-32GB") or (0, 0)) == "fp16"
    assert gpus.amp_dtype_for(gpus.capability_of("Tesla T4") or (0, 0)) == "fp16"
    assert gpus.amp_dtype_for(gpus.capability_of("A100-SXM4-80GB") or (0, 0)) == "bf16"
    assert gpus.capability_of("NVIDIA A10") == (8, 6)  # not A100's entry
    assert gpus.amp_dtype_for(gpus.capability_of("NVIDIA H100 80GB HBM3") or (0, 0)) == "bf16"
    assert gpus.capability_of("Mystery Accelerator") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpus_own_capability_agrees_with_the_table() -> None:
    name = torch.cuda.get_device_name(0)
    capability = torch.cuda.get_device_capability(0)
    listed = gpus.capability_of(name)
    if listed is not None:
        assert listed == capability, name
    assert (bf16_problem(torch.device("cuda", 0)) == "") == gpus.bf16_native(capability)
