"""The multi-LoRA shrink and expand: the torch reference against a float64 per-row loop, the CPU path and the
Triton kernels (under the interpreter) against the reference, and which backend serves a call."""

from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import native
from pagedserve.kernels.lora import cpu, reference
from pagedserve.kernels.lora import triton as lora_triton
from pagedserve.kernels.lora.grouping import group_slots
from tests.support.kernel_checks import compile_for_sm90, spy

K, N = 37, 29  # odd sizes: partial K and N tiles
MIXED = [2, -1, 0, 2, 2, -1, 1, 0, -1, 2, 0, 0, 2]  # every adapter's rows scattered, base rows between
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}  # the interpreter truncates to bf16 where torch rounds
IMPLEMENTATIONS = {"cpu": cpu, "triton": lora_triton}


def _weights(slots: int, rank: int, dtype: torch.dtype, seed: int = 0, k: int = K, n: int = N):
    """Stacked A [S, R, K] and B [S, N, R] scaled to keep the deltas O(1)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, rank, k, generator=gen) / k ** 0.5
    b = torch.randn(slots, n, rank, generator=gen) / rank ** 0.5
    return a.to(dtype), b.to(dtype)


def _rows(tokens: int, dtype: torch.dtype, width: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tol(dtype: torch.dtype) -> dict:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


class _GridRecorder:
    """Stands in for a Triton kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel, grids: list) -> None:
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _per_row(x, a, b, slots) -> torch.Tensor:
    """The delta each row's adapter adds, one row at a time in float64."""
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            delta[t] = b[slot].double() @ (a[slot].double() @ x[t].double())
    return delta


@pytest.mark.parametrize("slots", [MIXED, [-1] * 5, [1] * 6], ids=["mixed", "all_base", "one_adapter"])
def test_reference_equals_a_per_row_loop(slots):
    slots = torch.tensor(slots)
    x, (a, b) = _rows(len(slots), torch.float32), _weights(3, 16, torch.float32)
    out = torch.randn(len(slots), N + 4, dtype=torch.float64).float()
    before = out.clone()
    reference.lora_expand_add(out, reference.lora_shrink(x, a, slots), b, slots, offset=4)
    torch.testing.assert_close(out[:, 4:].double() - before[:, 4:].double(), _per_row(x, a, b, slots), **FP32_TOL)
    assert torch.equal(out[:, :4], before[:, :4])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_shrink_then_expand_equals_the_reference_on_mixed_rows(impl, dtype, rank):
    module, slots = IMPLEMENTATIONS[impl], torch.tensor(MIXED, dtype=torch.int32)
    x, (a, b) = _rows(len(MIXED), dtype, seed=rank), _weights(3, rank, dtype, seed=rank)
    y = module.lora_shrink(x, a, slots)
    want_y = reference.lora_shrink(x, a, slots)
    assert y.dtype == dtype and y.shape == (len(MIXED), rank)
    torch.testing.assert_close(y, want_y, **_tol(dtype))
    assert not y[slots == -1].any()
    out = _rows(len(MIXED), dtype, width=N, seed=7)
    want = out.clone()
    module.lora_expand_add(out, want_y, b, slots)
    reference.lora_expand_add(want, want_y, b, slots)
    torch.testing.assert_close(out, want, **_tol(dtype))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_base_rows_are_left_bit_for_bit_and_absent_slots_never_read(impl):
    module, slots = IMPLEMENTATIONS[impl], torch.tensor([1, -1, 1, -1, -1, 1])
    x, (a, b) = _rows(6, torch.float32), _weights(3, 16, torch.float32)
    a[[0, 2]], b[[0, 2]] = float("nan"), float("nan")  # slots no row uses
    out = _rows(6, torch.float32, width=N, seed=3)
    out[slots == -1, :5] = -0.0  # a store of -0.0 + 0.0 would clear the sign: base rows are never written
    before = out.clone()
    y = module.lora_shrink(x, a, slots)
    module.lora_expand_add(out, y, b, slots)
    assert not y.isnan().any() and not out.isnan().any()
    assert torch.equal(out[slots == -1], before[slots == -1]) and out[slots == -1, :5].signbit().all()
    torch.testing.assert_close(out - before, _per_row(x, a, b, slots).float(), **FP32_TOL)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_batch_of_base_rows_only_changes_nothing(impl):
    module, slots = IMPLEMENTATIONS[impl], torch.full((5,), -1)
    x, (a, b) = _rows(5, torch.bfloat16), _weights(2, 8, torch.bfloat16)
    a[:], b[:] = float("nan"), float("nan")
    out = _rows(5, torch.bfloat16, width=N)
    before = out.clone()
    y = module.lora_shrink(x, a, slots)
    module.lora_expand_add(out, y, b, slots)
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(out, before)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_fused_qkv_takes_three_expands_at_offsets_into_one_output(impl):
    module, slots = IMPLEMENTATIONS[impl], torch.tensor(MIXED)
    x = _rows(len(MIXED), torch.float32)
    sizes = (24, 8, 8)
    fused = _rows(len(MIXED), torch.float32, width=sum(sizes), seed=5)
    want = fused.clone()
    offset = 0
    for i, n in enumerate(sizes):
        a, b = _weights(3, 16, torch.float32, seed=10 + i, n=n)
        module.lora_expand_add(fused, module.lora_shrink(x, a, slots), b, slots, offset)
        want[:, offset:offset + n] += _per_row(x, a, b, slots).float()
        offset += n
    torch.testing.assert_close(fused, want, **FP32_TOL)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_precomputed_groups_give_the_same_deltas_over_several_row_tiles(impl):
    module = IMPLEMENTATIONS[impl]
    slots = torch.tensor(MIXED * 6)[:70]  # two 64-row Triton tiles, each holding every slot
    slots[20:50] = 1  # and a contiguous run, which the CPU path takes as a slice
    groups = group_slots(slots)
    x, (a, b) = _rows(70, torch.float32), _weights(3, 16, torch.float32)
    y = module.lora_shrink(x, a, slots, groups)
    torch.testing.assert_close(y, reference.lora_shrink(x, a, slots), **FP32_TOL)
    out, want = torch.zeros(70, N), torch.zeros(70, N)
    module.lora_expand_add(out, y, b, slots, 0, groups)
    reference.lora_expand_add(want, y, b, slots)
    torch.testing.assert_close(out, want, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_k_is_split_across_programs_and_summed(monkeypatch, dtype):
    grids, kernel = [], lora_triton._lora_shrink_kernel
    monkeypatch.setattr(lora_triton, "_lora_shrink_kernel", _GridRecorder(kernel, grids))
    slots, x = torch.tensor(MIXED), _rows(len(MIXED), dtype, width=300)
    a, _ = _weights(3, 16, dtype, k=300)
    y = lora_triton.lora_shrink(x, a, slots)
    torch.testing.assert_close(y, reference.lora_shrink(x, a, slots), **_tol(dtype))
    assert y.dtype == dtype and grids == [(1, 1, 3)]  # 300 columns: three 128-wide K tiles


def test_groups_list_each_present_slot_once_with_its_rows_sorted():
    groups = group_slots(torch.tensor([2, -1, 0, 2, 3, 3, 3, 0]))
    got = [(slot, rows if isinstance(rows, slice) else rows.tolist()) for slot, rows in groups.groups]
    assert got == [(0, [2, 7]), (2, [0, 3]), (3, slice(4, 7))]
    assert groups.order.tolist() == [1, 2, 7, 0, 3, 4, 5, 6]


def test_an_empty_batch_returns_an_empty_rank_matrix():
    x, (a, b) = _rows(0, torch.float32), _weights(2, 8, torch.float32)
    slots = torch.zeros(0, dtype=torch.int64)
    for module in (reference, cpu, lora_triton):
        y = module.lora_shrink(x, a, slots)
        assert y.shape == (0, 8)
        module.lora_expand_add(torch.zeros(0, N), y, b, slots)


def test_cpu_tensors_take_the_grouped_cpu_path(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    shrinks, expands = spy(monkeypatch, cpu, "lora_shrink"), spy(monkeypatch, cpu, "lora_expand_add")
    slots, x, (a, b) = torch.tensor(MIXED), _rows(len(MIXED), torch.float32), _weights(3, 8, torch.float32)
    out = torch.zeros(len(MIXED), N)
    kernels.lora_expand_add(out, kernels.lora_shrink(x, a, slots), b, slots)
    assert len(shrinks) == 1 and len(expands) == 1
    torch.testing.assert_close(out, _per_row(x, a, b, slots).float(), **FP32_TOL)


def test_forcing_triton_runs_the_triton_kernels(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    shrinks = spy(monkeypatch, lora_triton, "lora_shrink")
    slots, x, (a, _) = torch.tensor(MIXED), _rows(len(MIXED), torch.float32), _weights(3, 8, torch.float32)
    torch.testing.assert_close(kernels.lora_shrink(x, a, slots), reference.lora_shrink(x, a, slots), **FP32_TOL)
    assert len(shrinks) == 1


@pytest.mark.parametrize("call, match", [
    (lambda x, a, b, s: kernels.lora_shrink(x[:, :-1], a, s), "x has K = 36"),
    (lambda x, a, b, s: kernels.lora_shrink(x, a, s[:-1]), "slots must be"),
    (lambda x, a, b, s: kernels.lora_expand_add(torch.zeros(3, N), torch.zeros(3, 8), b, s[:3], offset=1),
     "exceeds out's 29 columns"),
    (lambda x, a, b, s: kernels.lora_shrink(x, a, s, group_slots(s.clone())), "groups must be"),
])
def test_mismatched_shapes_are_refused_naming_the_operand(call, match):
    slots, x, (a, b) = torch.tensor(MIXED), _rows(len(MIXED), torch.float32), _weights(3, 8, torch.float32)
    with pytest.raises(AssertionError, match=match):
        call(x, a, b, slots)


# Runs in a fresh interpreter: here the kernels were decorated for TRITON_INTERPRET and cannot compile.
_AOT_SCRIPT = """
import json, torch
from pagedserve.kernels.aot import compile_launch, record_launches
from pagedserve.kernels.lora import group_slots
from pagedserve.kernels.lora import triton as lora_triton

bf16 = torch.bfloat16
with record_launches(lora_triton) as launches:
    for tokens in (8, 512):  # decode and prefill tiles, rank 64: the largest
        slots = torch.randint(-1, 4, (tokens,))
        x, a, b = torch.zeros(tokens, 4096, dtype=bf16), torch.zeros(4, 64, 4096, dtype=bf16), torch.zeros(4, 4096, 64, dtype=bf16)
        lora_triton.lora_shrink(x, a, slots, group_slots(slots))
        lora_triton.lora_expand_add(torch.zeros(tokens, 4096, dtype=bf16), torch.zeros(tokens, 64, dtype=bf16), b, slots)
print(json.dumps([compile_launch(launch) for launch in launches]))
"""


def test_the_kernels_compile_for_sm90_without_spills():
    from pagedserve.kernels.aot import SM90_MAX_SHARED_BYTES

    configs = compile_for_sm90(_AOT_SCRIPT)
    assert [(c["kernel"], c["constexprs"]["BLOCK_M"]) for c in configs] == [
        ("_lora_shrink_kernel", 16), ("_lora_expand_kernel", 16), ("_lora_shrink_kernel", 64), ("_lora_expand_kernel", 64)]
    assert all(c["stack_bytes"] == 0 and c["shared_bytes"] <= SM90_MAX_SHARED_BYTES for c in configs), configs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("b_layout", ["n_contiguous", "r_contiguous"])
@pytest.mark.parametrize("rows", [len(MIXED), cpu.NATIVE_MAX_ROWS + 7], ids=["native", "torch"])
def test_cpu_paths_equal_the_reference_on_scattered_rows_at_an_offset(dtype, rank, b_layout, rows):
    slots = torch.tensor((MIXED * 4)[:rows], dtype=torch.int32)
    x, (a, b) = _rows(rows, dtype, width=45, seed=rank), _weights(3, rank, dtype, seed=rank, k=45, n=N)
    if b_layout == "n_contiguous":  # the layout the engine's CPU wrappers stack B in
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    y = cpu.lora_shrink(x, a, slots)
    torch.testing.assert_close(y, reference.lora_shrink(x, a, slots), **_tol(dtype))
    out = _rows(rows, dtype, width=N + 9, seed=2)
    out[slots == -1] = -0.0
    want = out.clone()
    cpu.lora_expand_add(out, y, b, slots, offset=5)
    reference.lora_expand_add(want, y, b, slots, offset=5)
    torch.testing.assert_close(out, want, **_tol(dtype))
    assert out[slots == -1].signbit().all() and torch.equal(out[:, :5], want[:, :5])


def test_the_native_path_skips_all_base_rows_and_refuses_a_slot_beyond_the_stack():
    x, (a, b) = _rows(4, torch.float32, width=K), _weights(2, 16, torch.float32)
    out = torch.full((4, N), -0.0)
    y = cpu.lora_shrink(x, a, torch.full((4,), -1))
    cpu.lora_expand_add(out, y, b, torch.full((4,), -1))
    assert not y.any() and out.signbit().all()
    if native.load() is not None:
        with pytest.raises(ValueError, match="beyond the stacked adapters"):
            cpu.lora_shrink(x, a, torch.tensor([0, 1, 2, -1]))


def _fused_weights(sizes: list[int], rank: int, dtype: torch.dtype, seed: int):
    """A [S, P * R, K] for the parts, and each part's B as a view of one n-contiguous [S, R, sum N] storage (the
    engine's CPU layout), the parts' columns side by side."""
    a, _ = _weights(3, len(sizes) * rank, dtype, seed=seed, k=45)
    storage = _weights(3, sum(sizes), dtype, seed=seed + 1, k=rank)[0]  # [S, sum N, R] values
    storage = storage.transpose(1, 2).contiguous()  # [S, R, sum N]
    return a, [part.transpose(1, 2) for part in storage.split(sizes, dim=2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("sizes", [[29], [24, 8, 8], [31, 31]], ids=["one", "qkv", "gate_up"])
@pytest.mark.parametrize("rows", [len(MIXED), cpu.NATIVE_MAX_ROWS + 7], ids=["native", "torch"])
def test_one_call_for_every_part_equals_a_shrink_and_an_expand_per_part(dtype, rank, sizes, rows):
    slots = torch.tensor((MIXED * 4)[:rows], dtype=torch.int32)
    x = _rows(rows, dtype, width=45, seed=rank)
    a, parts = _fused_weights(sizes, rank, dtype, seed=rank)
    offsets = [3 + sum(sizes[:i]) for i in range(len(sizes))]
    out = _rows(rows, dtype, width=3 + sum(sizes) + 4, seed=2)
    out[slots == -1] = -0.0
    want = out.clone()
    served = cpu.lora_shrink_expand_add(out, x, a, parts, slots, offsets)
    assert served == (rows <= cpu.NATIVE_MAX_ROWS and native.load() is not None)
    if not served:
        kernels.lora_shrink_expand_add(out, x, a, parts, slots, offsets)
    y = reference.lora_shrink(x, a, slots)
    for i, (b, offset) in enumerate(zip(parts, offsets, strict=True)):
        reference.lora_expand_add(want, y[:, i * rank:(i + 1) * rank], b, slots, offset)
    torch.testing.assert_close(out, want, **_tol(dtype))
    assert out[slots == -1].signbit().all()
    assert torch.equal(out[:, :3], want[:, :3]) and torch.equal(out[:, -4:], want[:, -4:])


def test_parts_not_side_by_side_in_one_storage_take_the_per_part_path():
    slots = torch.tensor(MIXED, dtype=torch.int32)
    x = _rows(len(MIXED), torch.float32, width=45)
    a, parts = _fused_weights([16, 8], 8, torch.float32, seed=3)
    parts = [p.clone() for p in parts]  # each its own storage
    out = torch.zeros(len(MIXED), 24)
    assert not cpu.lora_shrink_expand_add(out, x, a, parts, slots, [0, 16])
    kernels.lora_shrink_expand_add(out, x, a, parts, slots, [0, 16])
    want = torch.zeros(len(MIXED), 24)
    want[:, :16] = _per_row(x, a[:, :8], parts[0], slots).float()
    want[:, 16:] = _per_row(x, a[:, 8:], parts[1], slots).float()
    torch.testing.assert_close(out, want, **FP32_TOL)


@pytest.mark.skipif(native.load() is None, reason="no native CPU kernels here")
def test_a_prepared_projection_call_equals_the_per_part_path_and_declines_what_it_cannot_serve(monkeypatch):
    from pagedserve.kernels.lora import native_projection

    sizes, rank = [24, 8, 8], 16
    a, parts = _fused_weights(sizes, rank, torch.float32, seed=5)
    offsets = [0, 24, 32]
    prepared = native_projection(a, parts, offsets)
    slots = torch.tensor(MIXED, dtype=torch.int32)
    x, out = _rows(len(MIXED), torch.float32, width=45), torch.zeros(len(MIXED), 40)
    want = out.clone()
    assert prepared(out, x, slots)
    y = reference.lora_shrink(x, a, slots)
    for i, (b, offset) in enumerate(zip(parts, offsets, strict=True)):
        reference.lora_expand_add(want, y[:, i * rank:(i + 1) * rank], b, slots, offset)
    torch.testing.assert_close(out, want, **FP32_TOL)
    many = torch.zeros(cpu.NATIVE_MAX_ROWS + 1, dtype=torch.int32)
    assert not prepared(torch.zeros(len(many), 40), _rows(len(many), torch.float32, width=45), many)
    assert not prepared(out, x, slots.long())  # the prepared call reads int32 slots only
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    assert not prepared(out, x, slots)
    assert native_projection(a, [p.clone() for p in parts], offsets) is None  # parts not in one storage
    assert native_projection(a.to(torch.float64), parts, offsets) is None
