"""SiLU-and-mul and GELU(tanh)-and-mul in Triton, rounding the activation to the input dtype before the multiply as
transformers does."""

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


@triton.jit
def _gelu_tanh_and_mul_kernel(
    out_ptr,  # [T, I]
    x_ptr,  # [T, 2I] rows [gate | up]
    stride_x, stride_o,
    INTERMEDIATE,
    BLOCK: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) rounded to the dtype, times up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    # 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation for negative u; the clamp keeps exp finite (the result
    # there is below 1e-30 of g either way).
    act = (g / (1.0 + tl.exp(tl.minimum(-2.0 * inner, 80.0)))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _launch(kernel, x: torch.Tensor) -> torch.Tensor:
    """Programs over (row, column tile) of a [T, 2I] input."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0, "x must be [T, 2I]"
    intermediate = x.shape[1] // 2
    out = torch.empty(x.shape[0], intermediate, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(intermediate))
        kernel[(x.shape[0], triton.cdiv(intermediate, block))](
            out, x, x.stride(0), out.stride(0), intermediate, BLOCK=block, num_warps=4,
        )
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.gelu_tanh_and_mul."""
    return _launch(_gelu_tanh_and_mul_kernel, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul."""
    return _launch(_silu_and_mul_kernel, x)
