"""RMSNorm with the fused residual add in Triton, rounding to the input dtype where transformers does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H]
    residual_out_ptr,  # [T, H] x + residual (unused without residual)
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (unused without residual)
    weight_ptr,  # [H]
    eps,
    stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Grid (T,): one row's (fused residual add and) RMSNorm, statistics in fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """kernels.norm.rms_norm: one program per row."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with unit last stride"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), "weight must be [H] contiguous"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_in = residual if residual is not None else x
    res_out = torch.empty_like(out) if residual is not None else out
    assert res_in.shape == x.shape and res_in.stride(-1) == 1, "residual must be [T, H] like x"
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            out, res_out, x, res_in, weight, eps,
            x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HIDDEN=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
            HAS_RESIDUAL=residual is not None, num_warps=8,
        )
    return out if residual is None else (out, res_out)
