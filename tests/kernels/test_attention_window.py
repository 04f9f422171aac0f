"""Sliding-window and soft-capped paged attention: the reference, the CPU path and the Triton kernels against
a slow per-sequence oracle with transformers' window rule (a query at p sees keys p - window < k <= p)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.attention import cpu as attention_cpu
from pagedserve.kernels.attention import reference
from pagedserve.kernels.attention import triton as attention_triton
from tests.support.kernel_checks import compile_for_sm90, needs_native
from tests.support.paged_attention import (
    BF16_TOL,
    DECODES,
    FP32_TOL,
    MIXED,
    PagedBatch,
    make_batch,
    per_sequence_attention,
)

# Windows below, at and across block and tile edges, one of a single key, one wider than every context.
WINDOWS = [1, 5, 16, 33, 1000]


def _call(module, batch: PagedBatch, window: int | None, soft_cap: float | None, **extra) -> torch.Tensor:
    return module.paged_attention(*batch.args(), sliding_window=window, logits_soft_cap=soft_cap, **extra)


def test_oracle_window_is_transformers_sliding_window_mask():
    from transformers.masking_utils import sliding_window_causal_mask_function

    allowed = sliding_window_causal_mask_function(3)
    expected = [[bool(allowed(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(6)] for q in range(6)]
    assert expected[5] == [False, False, False, True, True, True]  # keys 3, 4, 5: (5 - 3, 5]
    batch = make_batch([(6, 6)], 1, 1, 16, 16)
    batch.value_cache.zero_()
    for pos in range(6):  # value = one-hot of the key's position: the output row is the attention pattern
        batch.value_cache[batch.block_tables[0, 0], pos, 0, pos] = 1.0
    pattern = per_sequence_attention(batch, 3, None)[:, 0, :6] > 0
    assert pattern.tolist() == expected


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lens", [MIXED, DECODES, [(37, 37)]], ids=["mixed", "decodes", "fresh-prompt"])
def test_torch_reference_windowed_equals_oracle(lens, window):
    batch = make_batch(lens, 2, 4, 64, 16)
    torch.testing.assert_close(_call(reference, batch, window, None), per_sequence_attention(batch, window, None),
                               **FP32_TOL)


@pytest.mark.parametrize(("window", "soft_cap"), [(None, 2.0), (7, 1.5), (None, 50.0)])
@pytest.mark.parametrize("lens", [MIXED, DECODES, [(37, 37)]], ids=["mixed", "decodes", "fresh-prompt"])
def test_torch_reference_soft_capped_equals_oracle(lens, window, soft_cap):
    batch = make_batch(lens, 2, 2, 32, 16, seed=1)
    batch.query.mul_(3.0)  # scores of several units, where the cap bends them
    torch.testing.assert_close(_call(reference, batch, window, soft_cap),
                               per_sequence_attention(batch, window, soft_cap), **FP32_TOL)


def test_window_wider_than_every_context_changes_nothing():
    batch = make_batch(MIXED, 2, 4, 64, 16, seed=2)
    assert torch.equal(_call(reference, batch, 1000, None), reference.paged_attention(*batch.args()))


def test_window_changes_the_result_of_long_contexts():
    batch = make_batch(MIXED, 2, 4, 64, 16, seed=3)
    windowed = _call(reference, batch, 5, None)
    assert not torch.allclose(windowed, reference.paged_attention(*batch.args()), atol=1e-3)


@needs_native
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_cpu_windowed_equals_oracle(lens, window):
    batch = make_batch(lens, 2, 4, 64, 16, seed=4)
    torch.testing.assert_close(_call(attention_cpu, batch, window, None), per_sequence_attention(batch, window, None),
                               **FP32_TOL)


@needs_native
@pytest.mark.parametrize(("window", "soft_cap"), [(None, 2.0), (9, 1.5)])
@pytest.mark.parametrize("lens", [MIXED, DECODES, [(37, 37)]], ids=["mixed", "decodes", "fresh-prompt"])
def test_cpu_soft_capped_equals_oracle(lens, window, soft_cap):
    batch = make_batch(lens, 1, 8, 64, 16, seed=5)
    batch.query.mul_(3.0)
    torch.testing.assert_close(_call(attention_cpu, batch, window, soft_cap),
                               per_sequence_attention(batch, window, soft_cap), **FP32_TOL)


@needs_native
def test_cpu_windowed_bf16_stays_within_bf16_rounding():
    batch = make_batch(MIXED, 2, 4, 64, 16, dtype=torch.bfloat16, seed=6)
    out = _call(attention_cpu, batch, 20, 30.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), per_sequence_attention(batch, 20, 30.0), **BF16_TOL)


# Each (window, soft cap) pairs with one shape: the interpreter is slow.
TRITON_CASES = [
    pytest.param(5, None, 2, 4, 16, id="w5-gqa4-bs16"),
    pytest.param(33, None, 1, 8, 32, id="w33-gqa8-bs32"),
    pytest.param(1, None, 2, 1, 16, id="w1-gqa1-bs16"),
    pytest.param(None, 2.0, 2, 4, 16, id="cap-gqa4"),
    pytest.param(16, 1.5, 1, 8, 16, id="w16-cap-gqa8"),
]


@pytest.mark.parametrize(("window", "soft_cap", "num_kv_heads", "group", "block_size"), TRITON_CASES)
def test_triton_mixed_batch_windowed_and_capped_equals_oracle(window, soft_cap, num_kv_heads, group, block_size):
    batch = make_batch(MIXED, num_kv_heads, group, 64, block_size, seed=7)
    batch.query.mul_(3.0)
    torch.testing.assert_close(_call(attention_triton, batch, window, soft_cap),
                               per_sequence_attention(batch, window, soft_cap), **FP32_TOL)


def test_triton_long_chunk_with_window_spans_unmasked_tiles():
    # 128-row tiles whose window leaves a band of keys every row sees, between two masked edges.
    batch = make_batch([(260, 400), (1, 300)], 1, 2, 64, 16, seed=8)
    torch.testing.assert_close(_call(attention_triton, batch, 150, None), per_sequence_attention(batch, 150, None),
                               **FP32_TOL)


@pytest.mark.parametrize(("num_splits", "window", "soft_cap"), [(1, 40, None), (4, 40, None), (4, 7, 2.0),
                                                                  (8, None, 2.0)])
def test_triton_split_k_decode_windowed_equals_oracle(num_splits, window, soft_cap):
    batch = make_batch(DECODES, 2, 4, 64, 16, seed=9)
    batch.query.mul_(3.0)
    out = _call(attention_triton, batch, window, soft_cap, num_splits=num_splits)
    torch.testing.assert_close(out, per_sequence_attention(batch, window, soft_cap), **FP32_TOL)


def test_dispatch_passes_window_and_cap_to_the_backend():
    from pagedserve import kernels

    batch = make_batch(MIXED, 2, 2, 32, 16, seed=10)
    torch.testing.assert_close(kernels.paged_attention(*batch.args(), sliding_window=9, logits_soft_cap=3.0),
                               per_sequence_attention(batch, 9, 3.0), **FP32_TOL)


@pytest.mark.parametrize(("field", "value"), [("sliding_window", 0), ("logits_soft_cap", 0.0)])
def test_dispatch_refuses_a_window_or_cap_that_is_not_positive(field, value):
    from pagedserve import kernels

    batch = make_batch(DECODES, 1, 1, 16, 16)
    with pytest.raises(ValueError, match=field):
        kernels.paged_attention(*batch.args(), **{field: value})


# Runs in a fresh interpreter (the kernels here were decorated for the interpreter and cannot compile).
_AOT_SCRIPT = """
import json, torch
from pagedserve.kernels.attention import triton as attention_triton
from pagedserve.kernels.aot import compile_launch, record_launches

def batch(lens, hq=16, hkv=8, d=256, bs=16):
    blocks = sum(-(-k // bs) for _, k in lens)
    cache = torch.zeros(blocks, bs, hkv, d, dtype=torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32)[None].expand(len(lens), -1).contiguous()
    q_lens = torch.tensor([q for q, _ in lens])
    cu = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int()
    query = torch.zeros(int(q_lens.sum()), hq, d, dtype=torch.bfloat16)
    return (query, cache, cache, tables, cu, torch.tensor([k for _, k in lens], dtype=torch.int32), 0.0625,
            int(q_lens.max()), max(k for _, k in lens))

gemma2 = dict(sliding_window=4096, logits_soft_cap=50.0)
with record_launches(attention_triton) as launches:
    attention_triton.paged_attention(*batch([(1, 8192)] * 2), **gemma2)  # windowed, capped decode
    attention_triton.paged_attention(*batch([(1, 8192)] * 2), **gemma2, num_splits=4)  # split over the window
    attention_triton.paged_attention(*batch([(512, 8192), (1, 700)]), **gemma2)  # prefill over 3 ranges
    attention_triton.paged_attention(*batch([(512, 512)], hq=32, d=128), sliding_window=1024)  # 128-row tiles
print(json.dumps([compile_launch(launch) for launch in launches]))
"""


@pytest.mark.slow
def test_windowed_and_capped_kernels_compile_for_sm90_without_spills():
    # Gemma 2's shapes (head size 256, GQA 2) and a 128-row tile: what the interpreter cannot check.
    configs = compile_for_sm90(_AOT_SCRIPT)
    assert [(c["constexprs"].get("WINDOWED"), c["constexprs"].get("SOFT_CAP")) for c in configs if
            "WINDOWED" in c["constexprs"]] == [(True, True)] * 3 + [(True, False)]
    for config in configs:
        assert config["stack_bytes"] == 0, config  # no register spills
        assert config["shared_bytes"] <= 232448, config  # 227 KB per block on sm_90


@pytest.mark.slow
def test_gemma2_engine_on_triton_kernels_matches_transformers_greedy(tmp_path, monkeypatch, hf_reference):
    # Windowed, soft-capped attention and GeGLU all on the Triton kernels (interpreter), prompts past the window.
    from pagedserve.backend.core.sampling_params import SamplingParams
    from pagedserve.backend.engine.llm_engine import LLMEngine
    from pagedserve.kernels.activation import triton as activation_triton
    from pagedserve.testing import make_tiny_model
    from tests.support.kernel_checks import spy

    path = make_tiny_model(tmp_path / "gemma2", "gemma2", seed=34, random_norms=True, tie_word_embeddings=True)
    attention_calls = spy(monkeypatch, attention_triton, "paged_attention")
    gelu_calls = spy(monkeypatch, activation_triton, "gelu_tanh_and_mul")
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    engine = LLMEngine.from_pretrained(str(path), dtype="float32", device="cpu", block_size=4, num_blocks=16,
                                       max_num_batched_tokens=10, max_num_seqs=2)
    prompts = [[5, 17, 33, 90, 41, 7, 250, 3, 64, 12, 8, 300, 77], [19, 45, 101, 6, 222, 13, 58, 91, 140, 2, 31]]
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert attention_calls and gelu_calls
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_reference.greedy(path, prompt, 5)[0]
