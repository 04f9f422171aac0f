"""Paged attention with bidirectional ranges (Gemma 3: an image's tokens see each other both ways) against a dense
masked softmax per sequence whose mask is transformers' Gemma 3 rule: full layers causal OR same-image-run,
sliding layers (causal OR same-image-run) AND p > pos - window."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import kv8
from pagedserve.kernels.attention import cpu as attention_cpu
from pagedserve.kernels.attention import reference
from tests.support.kernel_checks import needs_native
from tests.support.paged_attention import BF16_TOL, FP32_TOL, PagedBatch, make_batch

# (name, [(q_len, seq_len)], {sequence: [image runs as absolute [start, end)]}); every run ends by seq_len.
CASES = [
    # A chunk after a cached prefix: a run cut by the chunk's start, one inside it, one ending at its end.
    ("after-prefix", [(40, 70)], {0: [(26, 38), (44, 52), (61, 70)]}),
    # A fresh prompt (nothing cached): runs at its start and in its middle.
    ("fresh-prompt", [(37, 37)], {0: [(0, 9), (20, 31)]}),
    # Several sequences with decodes between them; two runs in one chunk; a run ending at a chunk's first query.
    ("several", [(1, 45), (24, 50), (17, 17), (1, 1), (3, 64), (1, 40), (12, 30)],
     {1: [(26, 27), (30, 41), (43, 50)], 2: [(3, 14)], 4: [(55, 62)], 6: [(18, 23), (24, 29)]}),
    # One-token prefill chunks: the last token of a run and the middle of a run (its range reaches no further).
    ("one-token-chunks", [(1, 33), (1, 20), (5, 48)], {0: [(30, 33)], 1: [(10, 20)], 2: [(40, 48)]}),
]
CASE_IDS = [case[0] for case in CASES]


def runs_to_ranges(batch: PagedBatch, runs: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    """The [T, 2] int32 ranges: a token inside an image run sees that run, every other token [0, 0)."""
    rows = []
    for s in range(batch.seq_lens.numel()):
        start, end, seq_len = int(batch.cu_seqlens_q[s]), int(batch.cu_seqlens_q[s + 1]), int(batch.seq_lens[s])
        for i in range(end - start):
            pos = seq_len - (end - start) + i
            rows.append(next(((a, b) for a, b in runs.get(s, []) if a <= pos < b), (0, 0)))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def dense_mask(q_pos: torch.Tensor, seq_len: int, ranges: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, seq_len] bool: (p <= pos or lo <= p < hi) and p > pos - window."""
    p = torch.arange(seq_len)[None, :]
    pos, lo, hi = q_pos[:, None], ranges[:, :1].long(), ranges[:, 1:].long()
    mask = (p <= pos) | ((p >= lo) & (p < hi))
    return mask & (p > pos - window) if window is not None else mask


def oracle(batch: PagedBatch, ranges: torch.Tensor, window: int | None = None, soft_cap: float | None = None,
           kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:  # -> [T, Hq, D] fp32
    """Per sequence: K/V gathered slot by slot through the block table (an fp8 cache read as stored * scale), a
    dense masked fp32 softmax."""
    block_size, num_kv_heads = batch.key_cache.shape[1], batch.key_cache.shape[2]
    group = batch.query.shape[1] // num_kv_heads
    out = torch.empty(batch.query.shape, dtype=torch.float32)
    for s in range(batch.seq_lens.numel()):
        start, end, seq_len = int(batch.cu_seqlens_q[s]), int(batch.cu_seqlens_q[s + 1]), int(batch.seq_lens[s])
        slots = [(int(batch.block_tables[s, p // block_size]), p % block_size) for p in range(seq_len)]
        k = torch.stack([batch.key_cache[b, o].float() * kv_scales[0] for b, o in slots])
        v = torch.stack([batch.value_cache[b, o].float() * kv_scales[1] for b, o in slots])
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        scores = torch.einsum("qhd,khd->hqk", batch.query[start:end].float(), k) * batch.scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        mask = dense_mask(q_pos, seq_len, ranges[start:end], window)
        probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def _case(name: str, num_kv_heads: int = 2, group: int = 4, head_dim: int = 32, block_size: int = 16,
          seed: int = 0) -> tuple[PagedBatch, torch.Tensor]:
    _, lens, runs = CASES[CASE_IDS.index(name)]
    batch = make_batch(lens, num_kv_heads, group, head_dim, block_size, seed=seed)
    batch.query.mul_(2.0)  # peaked softmaxes: a wrongly hidden or shown key moves the output visibly
    return batch, runs_to_ranges(batch, runs)


def _call(module, batch: PagedBatch, ranges: torch.Tensor | None, window: int | None = None,
          soft_cap: float | None = None, **extra) -> torch.Tensor:
    return module.paged_attention(*batch.args(), sliding_window=window, logits_soft_cap=soft_cap,
                                  bidirectional_ranges=ranges, **extra)


def test_oracle_mask_is_transformers_gemma3_mask():
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )

    token_type = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0]])  # three images between text
    image = token_type == 1
    groups = torch.cumsum((image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]).int(), 1) - 1
    block_ids = torch.where(image, groups, -1)  # as Gemma 3's get_block_sequence_ids_for_mask
    runs = {0: [(1, 4), (6, 8), (9, 13)]}
    batch = make_batch([(14, 14)], 1, 1, 16, 16)
    ranges = runs_to_ranges(batch, runs)
    full = or_masks(causal_mask_function, blockwise_overlay(block_ids))
    for window, allowed in [(None, full), (3, and_masks(sliding_window_overlay(3), full))]:
        expected = [[bool(allowed(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(14)] for q in range(14)]
        assert dense_mask(torch.arange(14), 14, ranges, window).tolist() == expected
    assert expected[10][12] and not expected[10][6]  # sees its own image ahead; not an earlier one out of window


def test_empty_ranges_equal_causal_attention():
    batch, ranges = _case("several")
    empty = torch.zeros_like(ranges)
    torch.testing.assert_close(_call(reference, batch, empty, 7), reference.paged_attention(
        *batch.args(), sliding_window=7), **FP32_TOL)


def test_ranges_change_the_result_of_image_tokens_only():
    batch, ranges = _case("after-prefix")
    causal = reference.paged_attention(*batch.args())
    ranged = _call(reference, batch, ranges)
    differs = (ranged - causal).abs().amax(dim=(1, 2)) > 1e-4
    sees_ahead = ranges[:, 1].long() > torch.arange(30, 70) + 1  # a key after itself in its run
    assert torch.equal(differs, sees_ahead) and sees_ahead.any()


@pytest.mark.parametrize("name", CASE_IDS)
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 4), (1, 1)], ids=["gqa4", "mha"])
def test_reference_equals_oracle(name, num_kv_heads, group):
    batch, ranges = _case(name, num_kv_heads, group)
    torch.testing.assert_close(_call(reference, batch, ranges), oracle(batch, ranges), **FP32_TOL)


@pytest.mark.parametrize("name", CASE_IDS)
@pytest.mark.parametrize(("window", "soft_cap"), [(4, None), (9, None), (None, 3.0), (6, 2.0)])
def test_reference_windowed_and_capped_equals_oracle(name, window, soft_cap):
    # Windows of 4 and 6 cut into runs of up to 12 tokens: a token sees the run's keys ahead, not all behind it.
    batch, ranges = _case(name, seed=1)
    torch.testing.assert_close(_call(reference, batch, ranges, window, soft_cap),
                               oracle(batch, ranges, window, soft_cap), **FP32_TOL)


def _to_fp8(batch: PagedBatch, dtype: torch.dtype, k_scale: float, v_scale: float) -> PagedBatch:
    batch.key_cache = kv8.quantize(batch.key_cache, dtype, k_scale)
    batch.value_cache = kv8.quantize(batch.value_cache, dtype, v_scale)
    return batch


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("name", ["after-prefix", "several"])
def test_reference_fp8_cache_equals_oracle(name, dtype):
    batch, ranges = _case(name, seed=2)
    batch = _to_fp8(batch, dtype, 0.05, 0.02)
    out = _call(reference, batch, ranges, 5, 2.5, k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(out, oracle(batch, ranges, 5, 2.5, (0.05, 0.02)), **FP32_TOL)


def test_entry_sends_ranges_only_to_modules_that_declare_support(monkeypatch):
    from pagedserve import kernels
    from tests.support.kernel_checks import spy

    batch, ranges = _case("several", seed=3)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "auto")
    monkeypatch.setattr(attention_cpu, "SUPPORTS_BIDIRECTIONAL", False, raising=False)
    ref_calls, cpu_calls = spy(monkeypatch, reference, "paged_attention"), spy(monkeypatch, attention_cpu,
                                                                                "paged_attention")
    out = kernels.paged_attention(*batch.args(), sliding_window=6, bidirectional_ranges=ranges)
    assert len(ref_calls) == 1 and not cpu_calls
    torch.testing.assert_close(out, oracle(batch, ranges, 6), **FP32_TOL)
    kernels.paged_attention(*batch.args())  # no ranges: the CPU module as before
    assert len(ref_calls) == 1 and len(cpu_calls) == 1


@needs_native
def test_entry_sends_ranges_to_the_cpu_module_that_declares_them(monkeypatch):
    from pagedserve import kernels
    from tests.support.kernel_checks import spy

    batch, ranges = _case("after-prefix", seed=3)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "auto")
    assert attention_cpu.SUPPORTS_BIDIRECTIONAL and reference.SUPPORTS_BIDIRECTIONAL
    cpu_calls = spy(monkeypatch, attention_cpu, "paged_attention")
    out = kernels.paged_attention(*batch.args(), bidirectional_ranges=ranges)
    assert len(cpu_calls) == 1
    torch.testing.assert_close(out, oracle(batch, ranges), **FP32_TOL)


@pytest.mark.parametrize(("ranges", "message"), [
    (torch.zeros(3, 2, dtype=torch.int32), r"bidirectional_ranges must be \["),
    (torch.zeros(59, dtype=torch.int32), r"bidirectional_ranges must be \["),
    (torch.zeros(59, 2), "bidirectional_ranges must be int32"),
])
def test_entry_refuses_malformed_ranges_naming_the_field(ranges, message):
    from pagedserve import kernels

    batch, _ = _case("several")
    assert batch.query.shape[0] == 59
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(*batch.args(), bidirectional_ranges=ranges)


def test_llama_attention_passes_the_step_ranges_through(monkeypatch):
    from types import SimpleNamespace

    from pagedserve import kernels
    from pagedserve.backend.model.attention import AttentionMetadata
    from pagedserve.backend.model.llama import Attention

    batch, ranges = _case("after-prefix", num_kv_heads=2, group=2)
    calls: list = []
    real = kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    layer = SimpleNamespace(scale=batch.scale, sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0)
    meta = AttentionMetadata(torch.zeros(40, dtype=torch.int64), batch.block_tables, batch.cu_seqlens_q,
                             batch.seq_lens, 40, 70)
    caches = (batch.key_cache, batch.value_cache)
    Attention.attend(layer, batch.query, caches, meta)
    assert "bidirectional_ranges" not in calls[-1]  # a step without images keeps the call it always made
    meta.bidirectional_ranges = ranges
    torch.testing.assert_close(Attention.attend(layer, batch.query, caches, meta), oracle(batch, ranges),
                               **FP32_TOL)
    assert calls[-1]["bidirectional_ranges"] is ranges


@needs_native
@pytest.mark.parametrize("name", CASE_IDS)
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (4, None), (6, 2.0), (40, None), (None, 3.0)])
def test_cpu_equals_oracle(name, window, soft_cap):
    # A window of 40 reaches key 0 from the early runs' rows (one unmasked pass) but not from the late ones.
    batch, ranges = _case(name, seed=4)
    torch.testing.assert_close(_call(attention_cpu, batch, ranges, window, soft_cap),
                               oracle(batch, ranges, window, soft_cap), **FP32_TOL)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_fp8_cache_equals_oracle(dtype):
    batch, ranges = _case("several", seed=5)
    batch = _to_fp8(batch, dtype, 0.05, 0.02)
    out = _call(attention_cpu, batch, ranges, 5, 2.5, k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(out, oracle(batch, ranges, 5, 2.5, (0.05, 0.02)), **FP32_TOL)


@needs_native
def test_cpu_bf16_stays_within_bf16_rounding():
    _, lens, runs = CASES[CASE_IDS.index("several")]
    batch = make_batch(lens, 2, 4, 64, 16, dtype=torch.bfloat16, seed=6)
    ranges = runs_to_ranges(batch, runs)
    out = _call(attention_cpu, batch, ranges, 9, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), oracle(batch, ranges, 9), **BF16_TOL)


@needs_native
def test_cpu_cuts_only_the_chunks_whose_ranges_reach_ahead(monkeypatch):
    from tests.support.kernel_checks import spy

    batch, ranges = _case("several", seed=7)
    ranged, plain = spy(monkeypatch, attention_cpu, "_ranged_chunk"), spy(monkeypatch, attention_cpu, "_prefill_chunk")
    runs = spy(monkeypatch, attention_cpu, "_run_rows")
    _call(attention_cpu, batch, ranges)
    # Sequences 1, 2 and 6 hold runs ahead of some query; 4's run ends at its first query, so it adds nothing.
    assert [args[4] for args in ranged] == [50, 17, 30]
    assert [(args[4], args[5]) for args in runs] == [(30, (30, 41)), (43, (43, 50)), (3, (3, 14)), (18, (18, 23)),
                                                     (24, (24, 29))]
    # Causal rows between them end at their last position: sequence 4 whole, then the text around each run.
    assert [(args[0].shape[0], args[4]) for args in plain] == [(4, 30), (3, 43), (1, 50), (3, 3), (4, 17), (3, 64),
                                                               (2, 24), (2, 30)]
    one_token, one_token_ranges = _case("one-token-chunks")
    # One-token chunks are their sequences' last tokens: only the five-token chunk (2) needs cutting.
    assert attention_cpu._ranged_sequences(one_token_ranges, one_token.cu_seqlens_q, one_token.seq_lens) == {2}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("name", CASE_IDS)
@pytest.mark.parametrize(("window", "soft_cap", "dtype"), [(None, None, torch.float32), (40, 2.0, torch.float32),
                                                           (None, None, torch.bfloat16)])
def test_cpu_native_run_rows_equal_oracle(name, window, soft_cap, dtype, monkeypatch, one_thread):
    # Where the native prefill kernel is preferred (bf16 on AMX; forced here, so fp32 takes its portable loops), a
    # run's rows that all see keys [0, hi) go to it as one query at hi - 1 with every row stacked in its groups.
    from pagedserve.kernels.attention import cpu_prefill
    from tests.support.kernel_checks import spy

    monkeypatch.setattr(cpu_prefill, "preferred", lambda query, key_cache: True)
    _, lens, runs = CASES[CASE_IDS.index(name)]
    batch = make_batch(lens, 2, 4, 64, 16, dtype=dtype, seed=12)
    ranges = runs_to_ranges(batch, runs)
    native = spy(monkeypatch, attention_cpu, "_native_run")
    out = _call(attention_cpu, batch, ranges, window, soft_cap)
    # The one run of "one-token-chunks" that reaches ahead (rows 43..46) sits past a window of 40: masked SDPA.
    assert bool(native) == (name != "one-token-chunks" or window is None)
    torch.testing.assert_close(out.float(), oracle(batch, ranges, window, soft_cap),
                               **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


def _detached(batch: PagedBatch) -> torch.Tensor:
    """Ranges apart from their tokens (the contract allows any [lo, hi) up to seq_len): the first five queries of the
    70-token chunk after a prefix see keys 50..59 ahead of them, the next five see keys 2..9 (all behind them)."""
    ranges = torch.zeros(batch.query.shape[0], 2, dtype=torch.int32)
    ranges[:5] = torch.tensor([50, 60])
    ranges[5:10] = torch.tensor([2, 10])
    return ranges


@needs_native
@pytest.mark.parametrize("window", [None, 12])
def test_ranges_apart_from_their_tokens_equal_oracle(window):
    from pagedserve.kernels.attention import triton as attention_triton

    batch = make_batch([(40, 70), (1, 20)], 2, 2, 32, 16, seed=11)
    ranges = _detached(batch)
    for module in (reference, attention_cpu, attention_triton):
        torch.testing.assert_close(_call(module, batch, ranges, window), oracle(batch, ranges, window), **FP32_TOL)

# Under the interpreter: each case once, GQA 4 (one 64-row tile holds 16 tokens) and MHA, windows cutting into runs.
TRITON_CASES = [
    pytest.param("after-prefix", 2, 4, None, None, id="after-prefix-gqa4"),
    pytest.param("after-prefix", 1, 1, 4, 2.0, id="after-prefix-mha-w4-cap"),
    pytest.param("fresh-prompt", 2, 2, 6, None, id="fresh-prompt-gqa2-w6"),
    pytest.param("several", 2, 4, None, 3.0, id="several-gqa4-cap"),
    pytest.param("several", 1, 8, 5, None, id="several-gqa8-w5"),
    pytest.param("one-token-chunks", 2, 4, None, None, id="one-token-chunks"),
]


@pytest.mark.parametrize(("name", "num_kv_heads", "group", "window", "soft_cap"), TRITON_CASES)
def test_triton_equals_oracle(name, num_kv_heads, group, window, soft_cap):
    from pagedserve.kernels.attention import triton as attention_triton

    batch, ranges = _case(name, num_kv_heads, group, seed=8)
    torch.testing.assert_close(_call(attention_triton, batch, ranges, window, soft_cap),
                               oracle(batch, ranges, window, soft_cap), **FP32_TOL)


def test_triton_fp8_cache_equals_oracle():
    from pagedserve.kernels.attention import triton as attention_triton

    batch, ranges = _case("several", seed=9)
    batch = _to_fp8(batch, torch.float8_e4m3fn, 0.05, 0.02)
    out = _call(attention_triton, batch, ranges, 7, 2.5, k_scale=0.05, v_scale=0.02)
    torch.testing.assert_close(out, oracle(batch, ranges, 7, 2.5, (0.05, 0.02)), **FP32_TOL)


def test_triton_run_past_the_tile_reaches_keys_of_later_tiles():
    # 16-token tiles (GQA 4): a 50-token image run spans four query tiles and 64-key steps; int64 ranges.
    from pagedserve.kernels.attention import triton as attention_triton

    batch = make_batch([(90, 130), (1, 20)], 1, 4, 32, 16, seed=10)
    ranges = runs_to_ranges(batch, {0: [(45, 95), (100, 129)]}).long()
    torch.testing.assert_close(_call(attention_triton, batch, ranges, 30, None), oracle(batch, ranges, 30),
                               **FP32_TOL)


# Runs in a fresh interpreter (the kernels here were decorated for the interpreter and cannot compile).
_AOT_SCRIPT = """
import json, torch
from pagedserve.kernels.attention import triton as attention_triton
from pagedserve.kernels.aot import compile_launch, record_launches

def batch(lens, hq, hkv, d, bs=16):
    blocks = sum(-(-k // bs) for _, k in lens)
    cache = torch.zeros(blocks, bs, hkv, d, dtype=torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32)[None].expand(len(lens), -1).contiguous()
    q_lens = torch.tensor([q for q, _ in lens])
    cu = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int()
    query = torch.zeros(int(q_lens.sum()), hq, d, dtype=torch.bfloat16)
    args = (query, cache, cache, tables, cu, torch.tensor([k for _, k in lens], dtype=torch.int32), 0.0625,
            int(q_lens.max()), max(k for _, k in lens))
    return args, torch.zeros(query.shape[0], 2, dtype=torch.int32)

with record_launches(attention_triton) as launches:
    args, ranges = batch([(512, 2048), (1, 700)], 8, 4, 256)  # Gemma 3 4B's heads: 64-row tiles, 3 ranges
    attention_triton.paged_attention(*args, sliding_window=1024, bidirectional_ranges=ranges)
    attention_triton.paged_attention(*args, bidirectional_ranges=ranges)
    args, ranges = batch([(512, 512)], 32, 8, 128)  # 128-row tiles
    attention_triton.paged_attention(*args, sliding_window=1024, bidirectional_ranges=ranges)
print(json.dumps([compile_launch(launch) for launch in launches]))
"""


@pytest.mark.slow
def test_ranged_prefill_kernels_compile_for_sm90_without_spills():
    from tests.support.kernel_checks import compile_for_sm90

    configs = compile_for_sm90(_AOT_SCRIPT)
    assert [(c["constexprs"]["RANGED"], c["constexprs"]["WINDOWED"], c["constexprs"]["BLOCK_M"]) for c in configs] == [
        (True, True, 64), (True, False, 64), (True, True, 128)]
    for config in configs:
        assert config["stack_bytes"] == 0, config  # no register spills
        assert config["shared_bytes"] <= 232448, config  # 227 KB per block on sm_90


@pytest.mark.slow
def test_gemma3_vlm_on_triton_kernels_matches_transformers_greedy(tmp_path, monkeypatch):
    # Gemma 3's image runs through the Triton kernels (interpreter), chunks of 12 tokens, windows of the tiny model.
    import transformers

    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.kernels.attention import triton as attention_triton
    from pagedserve.testing import tiny_image
    from pagedserve.testing_vlm import GEMMA3_IMAGE, make_tiny_gemma3_vl
    from tests.support.vlm import greedy_tokens, transformers_greedy, vlm_engine

    path = make_tiny_gemma3_vl(tmp_path / "gemma3_vl")
    prompts = [(f"Hello {GEMMA3_IMAGE} and {GEMMA3_IMAGE}: which is bigger?", [tiny_image(80, 20, seed=1),
                                                                               tiny_image(200, 60, seed=2)]),
               (f"{GEMMA3_IMAGE}The quick brown fox", [tiny_image(30, 40, seed=0)])]
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    expected = transformers_greedy(hf, transformers.AutoProcessor.from_pretrained(path, local_files_only=True),
                                   prompts, 6)
    calls: list = []
    real = attention_triton.paged_attention
    monkeypatch.setattr(attention_triton, "paged_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    engine = vlm_engine(path, max_num_batched_tokens=12)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert greedy_tokens(engine, prompts, params) == expected
    assert any(kw.get("bidirectional_ranges") is not None for kw in calls)


def test_the_gpu_checks_image_run_part_passes_as_its_dry_run(monkeypatch):
    # bench/kernels_gpu.py's check a GPU session runs (Gemma 3's heads there), tiny sizes under the interpreter here.
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import kernels_gpu

    results = kernels_gpu._bidirectional_checks(torch.device("cpu"), dry=True)
    assert len(results) == 2 and all(r["ok"] for r in results), results
