"""--outlook-kernel triton: VOLO's outlook attention with the unfold -> matmul -> fold in Triton.

Outlook attention (VOLO, arXiv:2106.13112, section 3.1): for each of the h x w window centres,
a [K*K, K*K] attention matrix mixes the KxK window of values around it, and the mixed windows
are folded back onto the H x W grid, summing where windows overlap. timm computes it as
nn.Unfold -> matmul -> F.fold, which writes the unfolded values (K*K times the values) and the
unfolded product to memory. Here two kernels do it without those copies:

- `_fold_kernel`: y[Y, X] = sum over the windows covering (Y, X), at offset k within each,
  of sum_l a[window, k, l] * v[neighbour l of the window]. Each program owns a row Y of outputs
  whose columns share X's residue mod the stride, so which window offsets cover them is the
  same for the whole program (a uniform branch, no atomics, a deterministic sum). With a's last
  two axes swapped the same kernel is the values' gradient: fold(a^T @ unfold(dy)).
- `_grad_attn_kernel`: da[window, k, l] = <dy at neighbour k, v at neighbour l>, over the head's
  channels.

Sums are in fp32 whatever the input dtypes. The softmax stays torch's (and attn_drop with it).
The kernels run as torch.library custom ops (opaque to torch.compile, which compiles the rest)
inside `OutlookFold`, a torch.autograd.Function. CUDA tensors run compiled kernels; CPU tensors
run the same kernels through Triton's interpreter (what TRITON_INTERPRET=1 selects), for tests.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from timm.models.volo import OutlookAttention
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# tl.sum and tl.zeros are jitted functions themselves, which an interpreted kernel cannot call
# unless TRITON_INTERPRET=1 was set before triton was imported; tl.reduce and tl.full are
# builtins. tl.sum is tl.reduce with this combine function (the interpreter sums it in numpy).
_sum = tl.standard._sum_combine

# Indices are int64 from the program ids and aranges on: no product overflows, and the
# interpreter skips its int32 overflow checks (half of its time on these kernels).


def _fold_kernel(
    a_ptr, sa_b, sa_n, sa_p, sa_k, sa_l,  # attention [B, heads, h*w, K*K, K*K], any strides
    v_ptr, sv_b, sv_y, sv_x, sv_c,  # values [B, H, W, C]
    y_ptr, sy_b, sy_y, sy_x, sy_c,  # output [B, H, W, C]
    heads, H, W, h, w, D,
    K: tl.constexpr, S: tl.constexpr, P: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bn = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    block = tl.program_id(2).to(tl.int64)
    residue = block % S  # this program's columns: X = residue + S * t
    b = bn // heads
    n = bn % heads
    col = residue + S * ((block // S) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64))
    col_ok = col < W
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    chan = n * D + d
    lane = tl.arange(0, BLOCK_L).to(tl.int64)  # l = li * K + lj, padded to a power of two
    l_ok = lane < K * K
    a_base = a_ptr + b * sa_b + n * sa_n
    v_base = v_ptr + b * sv_b + chan[None, None, :] * sv_c
    acc = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
    for ki in tl.static_range(K):
        i_num = row + P - ki  # window row i has `row` at offset ki when i * S - P + ki == row
        i = i_num // S
        if (i_num % S == 0) & (i_num >= 0) & (i < h):
            vy = i * S - P + lane // K
            vy_ok = l_ok & (vy >= 0) & (vy < H)
            for kj in tl.static_range(K):
                if (residue + P - kj) % S == 0:  # the same for every column of this program
                    j = (col + P - kj) // S
                    j_ok = col_ok & (j >= 0) & (j < w)
                    a_ptrs = a_base + (i * w + j)[:, None] * sa_p + (ki * K + kj) * sa_k
                    a_ok = j_ok[:, None] & l_ok[None, :]
                    attn = tl.load(a_ptrs + lane[None, :] * sa_l, mask=a_ok, other=0.0)
                    vx = j[:, None] * S - P + (lane % K)[None, :]
                    v_ok = a_ok & vy_ok[None, :] & (vx >= 0) & (vx < W)
                    v_ptrs = v_base + vy[None, :, None] * sv_y + vx[:, :, None] * sv_x
                    vals = tl.load(v_ptrs, mask=v_ok[:, :, None] & d_ok[None, None, :], other=0.0)
                    mixed = attn.to(tl.float32)[:, :, None] * vals.to(tl.float32)
                    acc += tl.reduce(mixed, 1, _sum)  # [BLOCK_T, BLOCK_D]
    out = y_ptr + b * sy_b + row * sy_y + col[:, None] * sy_x + chan[None, :] * sy_c
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])


def _grad_attn_kernel(
    g_ptr, sg_b, sg_y, sg_x, sg_c,  # output gradient [B, H, W, C]
    v_ptr, sv_b, sv_y, sv_x, sv_c,  # values [B, H, W, C]
    da_ptr, sd_b, sd_n, sd_p, sd_k, sd_l,  # attention gradient [B, heads, h*w, K*K, K*K]
    heads, H, W, h, w, D,
    K: tl.constexpr, S: tl.constexpr, P: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bn = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    b = bn // heads
    n = bn % heads
    j = tl.program_id(2).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    j_ok = j < w
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < D
    chan = n * D + d
    lane = tl.arange(0, BLOCK_L).to(tl.int64)  # l = li * K + lj, padded to a power of two
    l_ok = lane < K * K
    vy = i * S - P + lane // K
    vx = j[:, None] * S - P + (lane % K)[None, :]
    v_ok = j_ok[:, None] & l_ok[None, :] & (vy >= 0)[None, :] & (vy < H)[None, :]
    v_ok = v_ok & (vx >= 0) & (vx < W)
    v_ptrs = v_ptr + b * sv_b + vy[None, :, None] * sv_y + vx[:, :, None] * sv_x
    v_mask = v_ok[:, :, None] & d_ok[None, None, :]
    vals = tl.load(v_ptrs + chan[None, None, :] * sv_c, mask=v_mask, other=0.0)
    vals = vals.to(tl.float32)  # [BLOCK_T, BLOCK_L, BLOCK_D]: the window's K*K value vectors
    da_rows = da_ptr + b * sd_b + n * sd_n + (i * w + j)[:, None] * sd_p + lane[None, :] * sd_l
    for ki in tl.static_range(K):
        gy = i * S - P + ki
        for kj in tl.static_range(K):
            gx = j * S - P + kj
            g_ok = j_ok & (gx >= 0) & (gx < W) & (gy >= 0) & (gy < H)
            grads = tl.load(
                g_ptr + b * sg_b + gy * sg_y + gx[:, None] * sg_x + chan[None, :] * sg_c,
                mask=g_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            dots = tl.reduce(grads.to(tl.float32)[:, None, :] * vals, 2, _sum)  # [BLOCK_T, BLOCK_L]
            tl.store(
                da_rows + (ki * K + kj) * sd_k,
                dots.to(da_ptr.dtype.element_ty),
                mask=j_ok[:, None] & l_ok[None, :],
            )


# Compiled for CUDA tensors, interpreted for CPU ones (and for all under TRITON_INTERPRET=1, as
# triton.jit does): chosen per call, not fixed at import, so one process can check both.
KERNELS = {
    name: (JITFunction(fn), InterpretedFunction(fn))
    for name, fn in (("fold", _fold_kernel), ("grad_attn", _grad_attn_kernel))
}


def _launch(name: str, device: torch.device):
    if device.type not in ("cuda", "cpu"):
        raise RuntimeError(
            f"the triton outlook kernel runs on CUDA (or a CPU, interpreted): {device}"
        )
    compiled, interpreted = KERNELS[name]
    interpret = device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"
    return interpreted if interpret else compiled


def _geometry(values: torch.Tensor, heads: int, stride: int) -> tuple[int, int, int, int, int, int]:
    B, H, W, C = values.shape
    return B, H, W, math.ceil(H / stride), math.ceil(W / stride), C // heads


@torch.library.custom_op("vitpod::outlook_fold", mutates_args=())
def outlook_fold_op(
    attn: torch.Tensor, values: torch.Tensor, kernel: int, stride: int, padding: int, transp: bool
) -> torch.Tensor:
    """fold(attn @ unfold(values)), or with transp attn^T's (the values' gradient)."""
    heads = attn.shape[1]
    B, H, W, h, w, D = _geometry(values, heads, stride)
    out = torch.empty(values.shape, dtype=values.dtype, device=values.device)
    sa = list(attn.stride())
    if transp:
        sa[3], sa[4] = sa[4], sa[3]
    block_t = min(triton.next_power_of_2(w), 8)
    grid = (B * heads, H, stride * triton.cdiv(w, block_t))
    _launch("fold", values.device)[grid](
        attn, *sa, values, *values.stride(), out, *out.stride(), heads, H, W, h, w, D,
        K=kernel, S=stride, P=padding, BLOCK_T=block_t,
        BLOCK_L=triton.next_power_of_2(kernel * kernel), BLOCK_D=triton.next_power_of_2(D),
        num_warps=4,  # sm_90, head width 32: 105 registers a thread, no spills (ptxas -v)
    )  # fmt: skip
    return out


@outlook_fold_op.register_fake
def _(attn, values, kernel, stride, padding, transp):
    return torch.empty_like(values, memory_format=torch.contiguous_format)


def _grad_attn_empty(values: torch.Tensor, heads: int, kernel: int, stride: int) -> torch.Tensor:
    """fp32 [B, heads, h*w, K*K, K*K] stored as [B, h*w, heads, ...]: the layout of the Linear
    that made the attention, so the gradient reaches it without a copy."""
    B, _, _, h, w, _ = _geometry(values, heads, stride)
    kk = kernel * kernel
    full = torch.empty(B, h * w, heads, kk, kk, dtype=torch.float32, device=values.device)
    return full.permute(0, 2, 1, 3, 4)


@torch.library.custom_op("vitpod::outlook_grad_attn", mutates_args=())
def outlook_grad_attn_op(
    grad: torch.Tensor, values: torch.Tensor, heads: int, kernel: int, stride: int, padding: int
) -> torch.Tensor:
    """The attention's gradient: unfold(grad) @ unfold(values)^T per window, in fp32."""
    B, H, W, h, w, D = _geometry(values, heads, stride)
    out = _grad_attn_empty(values, heads, kernel, stride)
    block_t = min(triton.next_power_of_2(w), 8)
    grid = (B * heads, h, triton.cdiv(w, block_t))
    _launch("grad_attn", values.device)[grid](
        grad, *grad.stride(), values, *values.stride(), out, *out.stride(), heads, H, W, h, w, D,
        K=kernel, S=stride, P=padding, BLOCK_T=block_t,
        BLOCK_L=triton.next_power_of_2(kernel * kernel), BLOCK_D=triton.next_power_of_2(D),
        num_warps=8,  # sm_90, head width 32: 62 registers a thread, no spills (ptxas -v)
    )  # fmt: skip
    return out


@outlook_grad_attn_op.register_fake
def _(grad, values, heads, kernel, stride, padding):
    return _grad_attn_empty(values, heads, kernel, stride)


class OutlookFold(torch.autograd.Function):
    """y = fold(attn @ unfold(values)): attn [B, heads, h*w, K*K, K*K] after the softmax,
    values [B, H, W, C] (channels last), y [B, H, W, C] in the values' dtype."""

    @staticmethod
    def forward(ctx, attn, values, kernel: int, stride: int, padding: int):  # type: ignore[override]
        ctx.save_for_backward(attn, values)
        ctx.geometry = (kernel, stride, padding)
        return outlook_fold_op(attn, values, kernel, stride, padding, False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        attn, values = ctx.saved_tensors
        kernel, stride, padding = ctx.geometry
        grad_attn = grad_values = None
        if ctx.needs_input_grad[0]:
            heads = attn.shape[1]
            grad_attn = outlook_grad_attn_op(grad, values, heads, kernel, stride, padding)
            grad_attn = grad_attn.to(attn.dtype)
        if ctx.needs_input_grad[1]:
            grad_values = outlook_fold_op(attn, grad, kernel, stride, padding, True)
        return grad_attn, grad_values, None, None, None


class TritonOutlookAttention(OutlookAttention):
    """timm's OutlookAttention with `OutlookFold` in place of unfold -> matmul -> fold. Same
    parameters and state_dict keys (trainer/speed/outlook.py swaps the class of timm's modules)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        k, s, heads = self.kernel_size, self.stride, self.num_heads
        h, w = math.ceil(H / s), math.ceil(W / s)
        attn = self.pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        attn = self.attn(attn).reshape(B, h * w, heads, k * k, k * k).permute(0, 2, 1, 3, 4)
        attn = self.attn_drop((attn * self.scale).softmax(dim=-1))
        out = OutlookFold.apply(attn, self.v(x), k, s, self.padding)
        return self.proj_drop(self.proj(out))
