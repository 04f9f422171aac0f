"""Weight-only quantized layers: what the model runs in place of nn.Linear / nn.Embedding for int8 and int4 weights."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import quant_linear as ql
from pagedserve.kernels.quant_linear import QuantizedWeight

QUANTIZATIONS = ("none", "int8", "int4")
# llama.cpp's block size: min/max groups of 32 re-quantize the default model's own Q4_1 grid almost exactly
# (mean |delta logprob| 0.02 against fp32 on bench/quantized.py's text, 0.76 with groups of 64).
INT4_GROUP_SIZE = 32
# The decoder's projections; the embedding and lm_head stay as loaded (vLLM's on-the-fly methods do the same).
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class QuantizedLinear(nn.Module):
    """x @ W.T + b with W a QuantizedWeight (W8A16 / W4A16): activations keep their dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As nn.Linear."""
        return ql.quant_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        w = self.weight
        return f"in={w.in_features}, out={w.out_features}, bits={w.bits}, group_size={w.group_size}"


class QuantizedEmbedding(nn.Module):
    """Token embedding looked up from a QuantizedWeight: only the step's rows are dequantized."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """The rows of the dequantized table, in the model's dtype."""
        return self.weight.dequantize(self.dtype, rows=input_ids)


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """A float [N, K] weight as int8 per output channel or int4 in groups (asymmetric, min/max)."""
    if method == "int8":
        return ql.quantize_int8(weight)
    if method == "int4":
        return ql.quantize_int4(weight, INT4_GROUP_SIZE)
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")


def quantize_projections(model: nn.Module, method: str) -> int:
    """Replace the decoder's nn.Linear projections by QuantizedLinear (`method` int8 or int4); returns how many."""
    if method == "none":
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in _PROJECTIONS and isinstance(child, nn.Linear):
                with torch.no_grad():
                    layer = QuantizedLinear(quantize_weight(child.weight.detach(), method), child.bias)
                setattr(parent, name, layer)
                replaced += 1
    return replaced


def prepare_quantized(model: nn.Module) -> None:
    """Build every quantized weight's packed form for its device now, at load, not in the first step. An embedding
    table is held once: as the native CPU kernel's tiles when it packs it (they give any rows back directly), else
    as its canonical integers, which a tied table keeps beside a packing that cannot give rows back cheaply
    (torch's int4) and an untied one keeps alone (a packed copy would go unused)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, QuantizedEmbedding)}
    linears = {id(m.weight) for m in model.modules() if isinstance(m, QuantizedLinear)}
    for weight in quantized_weights(model):
        table = id(weight) in tables
        ql.prepare(weight, release=not table or weight.bits == 8)
        if table and "cpu_native" in weight.packed:
            ql.prepare(weight, release=True)
        elif table and id(weight) not in linears and weight.qweight is not None:
            weight.packed.clear()


def quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Each QuantizedWeight of the model once (a tied embedding and lm_head share one)."""
    seen: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            seen.setdefault(id(module.weight), module.weight)
    return list(seen.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take: parameters and buffers once each, plus the quantized weights and their
    packed forms."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for weight in quantized_weights(model):
        total += weight.nbytes() + weight.packed_nbytes()
    return total
