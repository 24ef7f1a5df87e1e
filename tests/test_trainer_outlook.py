"""The fused and Triton outlook attentions agree with timm's OutlookAttention: outputs and
gradients. The Triton kernels run compiled on CUDA and through Triton's interpreter on the CPU."""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch
from timm.models.volo import OutlookAttention

from vitpod.registry import models
from vitpod.trainer.__main__ import main
from vitpod.trainer.exitcodes import USAGE
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.settings.flags import parse_args
from vitpod.trainer.speed.outlook import (
    FusedOutlookAttention,
    TritonUnavailable,
    apply_outlook_kernel,
    use_fused_outlook,
    use_triton_outlook,
)

SHAPES = [  # (height, width, dim, heads, stride): stride 1, VOLO's stride 2, odd sizes, head
    (5, 5, 32, 2, 1),  # widths 16, 8 and 12 (12: the kernels' channel block is masked); small,
    (6, 3, 24, 3, 1),  # as the CPU runs the Triton kernels interpreted, one program at a time
    (8, 8, 32, 2, 2),
    (7, 9, 12, 1, 2),
]
# fp32 both ways; the kernels sum in another order than timm's matmul and fold
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NO_TRITON = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]  # gpu_check.sh runs these on a GPU
KERNELS = ["fused", pytest.param("triton", marks=NO_TRITON)]


def swap(module: torch.nn.Module, kernel: str, device: str, monkeypatch) -> int:
    if kernel == "fused":
        return use_fused_outlook(module)
    if device == "cpu":  # the trainer takes a CPU only when the interpreter is asked for
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return use_triton_outlook(module, torch.device(device))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("height", "width", "dim", "heads", "stride"), SHAPES)
def test_outputs_and_gradients_match_timm(
    height, width, dim, heads, stride, device, kernel, monkeypatch
):
    torch.manual_seed(0)
    ref = OutlookAttention(dim, heads, stride=stride, qkv_bias=True).to(device)
    new = copy.deepcopy(ref)
    assert swap(new, kernel, device, monkeypatch) == 1
    x_ref = torch.randn(2, height, width, dim, requires_grad=True, device=device)
    x_new = x_ref.detach().clone().requires_grad_()
    out_ref, out_new = ref(x_ref), new(x_new)
    torch.testing.assert_close(out_new, out_ref, **TOLERANCE)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_new.backward(grad)
    torch.testing.assert_close(x_new.grad, x_ref.grad, **TOLERANCE)
    for (name, p_ref), p_new in zip(ref.named_parameters(), new.parameters(), strict=True):
        torch.testing.assert_close(p_new.grad, p_ref.grad, **TOLERANCE, msg=name)


@NO_TRITON
@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernel_traces_under_torch_compile(device, monkeypatch):
    """Dynamo and AOT autograd see the custom ops through their fake kernels (the shapes and
    strides they promise): the compiled module's output and input gradient equal eager's."""
    torch.manual_seed(0)
    module = OutlookAttention(16, 2, stride=2).to(device)
    swap(module, "triton", device, monkeypatch)
    # Even sizes: torch 2.11's inductor gets AvgPool2d(ceil_mode=True)'s backward wrong on CUDA
    # at odd ones (timm's own OutlookAttention too; docs/benchmarks.md)
    x = torch.randn(2, 6, 8, 16, device=device, requires_grad=True)
    x_compiled = x.detach().clone().requires_grad_()
    backend = "inductor" if device == "cuda" else "aot_eager"  # inductor on CPU: slow to build
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x_compiled), module(x), **TOLERANCE)
    module(x).sum().backward()
    compiled(x_compiled).sum().backward()
    torch.testing.assert_close(x_compiled.grad, x.grad, **TOLERANCE)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_swap_keeps_every_parameter_and_the_whole_model_output(kernel, monkeypatch):
    torch.manual_seed(0)
    model = models.build("volo_tiny", 32, 10, 0.0).eval()
    new = copy.deepcopy(model)
    count = swap(new, kernel, "cpu", monkeypatch)
    assert count == sum(isinstance(m, OutlookAttention) for m in model.modules()) > 0
    kinds = {type(m).__name__ for m in new.modules() if isinstance(m, OutlookAttention)}
    assert kinds == {"FusedOutlookAttention" if kernel == "fused" else "TritonOutlookAttention"}
    assert new.state_dict().keys() == model.state_dict().keys()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(new(images), model(images), **TOLERANCE)


def test_timm_kernel_leaves_the_model_alone_and_an_unknown_name_raises():
    model = models.build("volo_tiny", 32, 10, 0.0)
    assert apply_outlook_kernel(model, "timm", torch.device("cpu")) == 0
    assert not any(isinstance(m, FusedOutlookAttention) for m in model.modules())
    with pytest.raises(ValueError, match="--outlook-kernel flash: choose one of timm, fused"):
        apply_outlook_kernel(model, "flash", torch.device("cpu"))


@pytest.mark.parametrize(
    ("flags", "fix"),
    [
        (["--model", "vit_tiny_patch16_224"], "has no outlook attention; drop it"),
        (["--model", "volo_tiny", "--tp", "2"], "with --tp 2: tensor parallelism runs its own"),
    ],
)
@pytest.mark.parametrize("kernel", ["fused", "triton"])
def test_a_kernel_the_run_would_not_use_is_refused(flags, fix, kernel):
    cfg = parse_args(["--dataset", "synthetic", *flags, "--outlook-kernel", kernel], world_size=2)
    found = [p for p in problems(cfg) if p.startswith(f"--outlook-kernel {kernel}")]
    assert len(found) == 1 and fix in found[0], found
    cfg = parse_args(["--dataset", "synthetic", *flags], world_size=2)
    assert not [p for p in problems(cfg) if p.startswith("--outlook-kernel")]


def test_triton_is_refused_on_a_cpu_unless_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = models.build("volo_tiny", 32, 10, 0.0)
    before = [type(m) for m in model.modules()]
    with pytest.raises(TritonUnavailable, match="needs a CUDA GPU.*--outlook-kernel fused") as err:
        apply_outlook_kernel(model, "triton", torch.device("cpu"))
    assert "\n" not in str(err.value)
    assert [type(m) for m in model.modules()] == before


@NO_TRITON
@pytest.mark.skipif(torch.cuda.is_available(), reason="the trainer takes the GPU there")
def test_the_trainer_runs_triton_on_a_cpu_only_interpreted(tmp_path, capsys, monkeypatch):
    args = ["--dataset", "synthetic", "--model", "volo_tiny", "--img-size", "32", "-b", "2",
            "--workers", "0", "--max-steps", "1", "--epochs", "1", "--warmup-epochs", "0",
            "--no-eval", "--outlook-kernel", "triton"]  # fmt: skip
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    refused = tmp_path / "refused"
    assert main([*args, "--output", str(refused)]) == USAGE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--outlook-kernel triton: needs a CUDA GPU" in errors[0]
    assert not any('"kind": "step"' in f.read_text() for f in refused.glob("metrics/*.jsonl"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = tmp_path / "run"
    assert main([*args, "--output", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "step"]
    assert len(steps) == 1 and math.isfinite(steps[0]["loss"])


@NO_TRITON
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA cases compile them for real")
@pytest.mark.parametrize(
    ("name", "pointers", "warps"),
    [("fold", ("*fp32", "*bf16", "*bf16"), 4), ("grad_attn", ("*bf16", "*bf16", "*fp32"), 8)],
)
def test_the_kernels_compile_for_an_h100_without_one(name, pointers, warps):
    """Triton's whole CUDA pipeline (front end to ptxas) for sm_90 at volo_d1's bf16 shapes: what
    the interpreter lets through but the compiler would refuse fails here, not on a lent GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from vitpod.trainer.speed.outlook_triton import KERNELS

    kernel = KERNELS[name][0]
    constexprs = {"K": 3, "S": 2, "P": 1, "BLOCK_T": 8, "BLOCK_L": 16, "BLOCK_D": 32}
    given = iter(pointers)
    signature = {
        arg: "constexpr" if arg in constexprs else next(given) if arg.endswith("_ptr") else "i32"
        for arg in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    binary = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert binary.asm["cubin"] and f".entry _{name}_kernel" in binary.asm["ptx"]
