"""The fused outlook attention agrees with timm's OutlookAttention: outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models.volo import OutlookAttention

from vitpod.registry import models
from vitpod.trainer.outlook import FusedOutlookAttention, apply_outlook_kernel, use_fused_outlook

SHAPES = [  # (height, width, dim, heads, stride): VOLO's stride 1, odd sizes, and stride 2
    (7, 7, 32, 2, 1),
    (9, 5, 24, 3, 1),
    (8, 8, 32, 2, 2),
    (7, 9, 16, 1, 2),
]


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]  # fp32; gpu_check.sh runs it on a GPU


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("height", "width", "dim", "heads", "stride"), SHAPES)
def test_outputs_and_gradients_match_timm(height, width, dim, heads, stride, device):
    torch.manual_seed(0)
    ref = OutlookAttention(dim, heads, stride=stride, qkv_bias=True).to(device)
    fused = copy.deepcopy(ref)
    assert use_fused_outlook(fused) == 1
    x_ref = torch.randn(2, height, width, dim, requires_grad=True, device=device)
    x_fused = x_ref.detach().clone().requires_grad_()
    out_ref, out_fused = ref(x_ref), fused(x_fused)
    torch.testing.assert_close(out_fused, out_ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_fused.backward(grad)
    torch.testing.assert_close(x_fused.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p_ref), p_fused in zip(ref.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(p_fused.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_the_swap_keeps_every_parameter_and_the_whole_model_output():
    torch.manual_seed(0)
    model = models.build("volo_tiny", 32, 10, 0.0).eval()
    fused = copy.deepcopy(model)
    count = apply_outlook_kernel(fused, "fused")
    assert count == sum(isinstance(m, OutlookAttention) for m in model.modules()) > 0
    assert all(
        type(m) is FusedOutlookAttention for m in fused.modules() if isinstance(m, OutlookAttention)
    )
    assert fused.state_dict().keys() == model.state_dict().keys()
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fused(images), model(images), rtol=1e-5, atol=1e-5)


def test_timm_kernel_leaves_the_model_alone_and_an_unknown_name_raises():
    model = models.build("volo_tiny", 32, 10, 0.0)
    assert apply_outlook_kernel(model, "timm") == 0
    assert not any(isinstance(m, FusedOutlookAttention) for m in model.modules())
    with pytest.raises(ValueError, match="--outlook-kernel triton"):
        apply_outlook_kernel(model, "triton")
