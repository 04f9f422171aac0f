"""The multi-LoRA shrink and expand on the CPU: small batches in one native call over all rows
(`lora_cpu.cpp`, each row reading its slot), larger ones one torch matmul per adapter present over its rows
(a slice when they are contiguous), never a per-row gather of the adapter weights; base-model rows are not
touched. Without the native library every batch takes the torch path."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from pagedserve.kernels import dispatch, native
from pagedserve.kernels.lora.grouping import SlotGroups, group_slots

_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_int64] * 8 + [ctypes.c_int]
_SLOT_ERROR = {2: "slots holds a slot beyond the stacked adapters' first dimension"}
_shrink_kernel = native.Function("pagedserve_lora_shrink", _ARGTYPES, _SLOT_ERROR)
_expand_kernel = native.Function("pagedserve_lora_expand_add", _ARGTYPES[:-1] + [ctypes.c_int64, ctypes.c_int],
                                 _SLOT_ERROR)
_fused_kernel = native.Function(
    "pagedserve_lora_shrink_expand_add",
    [ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_int64] * 10 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
    _SLOT_ERROR)
# Up to this many rows the native call beats a torch matmul per adapter present (docs/benchmarks.md).
NATIVE_MAX_ROWS = 32
_SLOT_BYTES = {torch.int32: 4, torch.int64: 8}


def _native(rows: int, slots: torch.Tensor, weights: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """True when the native kernels serve this call: few rows, unit column strides (either of the weights'
    last two dimensions), one fp32/bf16 dtype."""
    return (
        0 < rows <= NATIVE_MAX_ROWS
        and slots.dtype in _SLOT_BYTES and slots.is_contiguous() and slots.device.type == "cpu"
        and all(t.stride(-1) == 1 for t in tensors) and 1 in weights.stride()[1:]
        and native.serves(weights, *tensors)
    )


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
                groups: SlotGroups | None = None) -> torch.Tensor:
    """kernels.lora.lora_shrink: y[rows] = x[rows] @ A[slot].T per slot present, zeros elsewhere."""
    t, k = x.shape
    rank = lora_a.shape[1]
    if _native(t, slots, lora_a, x) and lora_a.stride(2) == 1:
        y = torch.empty(t, rank, dtype=x.dtype)
        _shrink_kernel(y.data_ptr(), x.data_ptr(), lora_a.data_ptr(), slots.data_ptr(), _SLOT_BYTES[slots.dtype],
                       t, k, rank, lora_a.shape[0], x.stride(0), rank, lora_a.stride(0), lora_a.stride(1),
                       native.dtype_code(x))
        return y
    groups = groups or group_slots(slots)
    y = x.new_zeros(t, rank)
    for slot, rows in groups.groups:
        if isinstance(rows, slice):
            torch.matmul(x[rows], lora_a[slot].T, out=y[rows])
        else:
            y.index_copy_(0, rows, x[rows] @ lora_a[slot].T)
    return y


def lora_expand_add(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                    offset: int = 0, groups: SlotGroups | None = None) -> None:
    """kernels.lora.lora_expand_add: out[rows, offset:offset + N] += y[rows] @ B[slot].T per slot present."""
    n = lora_b.shape[1]
    view = out[:, offset:offset + n]
    if _native(out.shape[0], slots, lora_b, view, y):
        _expand_kernel(view.data_ptr(), y.data_ptr(), lora_b.data_ptr(), slots.data_ptr(), _SLOT_BYTES[slots.dtype],
                       out.shape[0], n, y.shape[1], lora_b.shape[0], view.stride(0), y.stride(0), lora_b.stride(0),
                       lora_b.stride(1), lora_b.stride(2), native.dtype_code(out))
        return
    groups = groups or group_slots(slots)
    for slot, rows in groups.groups:
        if isinstance(rows, slice):
            view[rows].addmm_(y[rows], lora_b[slot].T)
        else:
            view.index_put_((rows,), torch.addmm(view[rows], y[rows], lora_b[slot].T))


def lora_shrink_expand_add(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                           slots: torch.Tensor, offsets: Sequence[int]) -> bool:
    """kernels.lora.lora_shrink_expand_add in one native call when it serves the tensors: few rows, and every
    part's B a column slice of one n-contiguous [S, R, N] storage at the columns its out slice has. False
    (nothing done) otherwise."""
    if not _fused_layout(out, x, lora_a, lora_b, slots, offsets):
        return False
    first = lora_b[0]
    view = out[:, offsets[0]:]
    _fused_kernel(view.data_ptr(), x.data_ptr(), lora_a.data_ptr(), first.data_ptr(), slots.data_ptr(),
                  _SLOT_BYTES[slots.dtype], x.shape[0], x.shape[1], first.shape[2], lora_a.shape[0], view.stride(0),
                  x.stride(0), lora_a.stride(0), lora_a.stride(1), first.stride(0), first.stride(2),
                  _part_columns(offsets, lora_b[-1].shape[1]),
                  len(lora_b), native.dtype_code(out))
    return True


class NativeProjection:
    """lora_shrink_expand_add of one projection's resident weights as a prepared native call: their layout is
    checked and their pointers and strides taken once, so a call checks only the step's rows (the Python around
    a call otherwise costs more than its arithmetic at decode sizes)."""

    def __init__(self, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor], offsets: Sequence[int]):
        first = lora_b[0]
        self.weights = (lora_a, *lora_b)  # held: the pointers below are theirs
        self.dtype, self.code = lora_a.dtype, native.dtype_code(lora_a)
        self.column = offsets[0] * first.element_size()
        self.fixed = (lora_a.shape[2], first.shape[2], lora_a.shape[0])  # k, rank, slots
        self.weight_args = (lora_a.stride(0), lora_a.stride(1), first.stride(0), first.stride(2))
        self.pointers = (lora_a.data_ptr(), first.data_ptr())
        self.columns = _part_columns(offsets, lora_b[-1].shape[1])
        self.num_parts = len(lora_b)

    @classmethod
    def of(cls, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor], offsets: Sequence[int]) -> NativeProjection | None:
        """The prepared call, or None where the native kernel cannot serve these weights."""
        probe_x = lora_a.new_empty(1, lora_a.shape[2])
        probe_out = lora_a.new_empty(1, offsets[-1] + lora_b[-1].shape[1])
        if not _fused_layout(probe_out, probe_x, lora_a, lora_b, torch.zeros(1, dtype=torch.int32), offsets):
            return None
        return cls(lora_a, lora_b, offsets)

    def __call__(self, out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> bool:
        """As lora_shrink_expand_add over these weights; False (nothing done) where the rows do not qualify."""
        rows = x.shape[0]
        if not (0 < rows <= NATIVE_MAX_ROWS and dispatch.mode() == "auto" and x.dtype is self.dtype and out.dtype is self.dtype
                and x.stride(1) == 1 and out.stride(1) == 1 and slots.dtype is torch.int32
                and slots.is_contiguous() and slots.device.type == "cpu"):
            return False
        k, rank, num_slots = self.fixed
        _fused_kernel(out.data_ptr() + self.column, x.data_ptr(), *self.pointers, slots.data_ptr(), 4, rows, k, rank,
                      num_slots, out.stride(0), x.stride(0), *self.weight_args, self.columns, self.num_parts,
                      self.code)
        return True


def _fused_layout(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
                  slots: torch.Tensor, offsets: Sequence[int]) -> bool:
    """True when the one-call kernel serves these tensors: few rows, native dtypes, and every part's B a
    column slice of one n-contiguous [S, R, N] storage at the columns its out slice has, parts side by side."""
    first = lora_b[0]
    if not (_native(x.shape[0], slots, lora_a, x, out) and lora_a.stride(2) == 1 and first.stride(1) == 1
            and all(b.stride() == first.stride() and b.dtype == out.dtype for b in lora_b)):
        return False
    size = first.element_size()
    return all(b.data_ptr() - first.data_ptr() == (offset - offsets[0]) * size and end in (None, offset + b.shape[1])
               for b, offset, end in zip(lora_b, offsets, (*offsets[1:], None), strict=True))


def _part_columns(offsets: Sequence[int], last_width: int) -> ctypes.Array:
    """The parts' column boundaries from the first part's column, as the C array the kernel reads."""
    return _column_array(tuple(o - offsets[0] for o in offsets) + (offsets[-1] - offsets[0] + last_width,))


@functools.lru_cache(maxsize=256)
def _column_array(columns: tuple[int, ...]) -> ctypes.Array:
    """One C array per distinct boundary tuple (a few projections per model)."""
    return (ctypes.c_int64 * len(columns))(*columns)
