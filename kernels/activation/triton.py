"""SiLU-and-mul in Triton, rounding SiLU to the input dtype before the multiply as transformers does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    x_ptr,  # [T, 2I] rows [gate | up]
    stride_x, stride_o,
    INTERMEDIATE,
    BLOCK: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)): silu(gate) rounded to the dtype, times up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul: programs over (row, column tile)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0, "x must be [T, 2I]"
    intermediate = x.shape[1] // 2
    out = torch.empty(x.shape[0], intermediate, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(intermediate))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(intermediate, block))](
            out, x, x.stride(0), out.stride(0), intermediate, BLOCK=block, num_warps=4,
        )
    return out
