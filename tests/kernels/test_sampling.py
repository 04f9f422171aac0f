"""The native CPU sampling ops (inverse-CDF draw, log-sum-exp, bf16 widening) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import to_float32
from pagedserve.kernels.sampling import cpu, reference
from tests.support.kernel_checks import needs_native

pytestmark = needs_native


def make_rows(rows: int = 64, vocab: int = 3000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::3, ::7] = -float("inf")  # top-k/top-p masks arrive as -inf
    inv_temps = 1.0 / (torch.rand(rows, generator=gen) * 1.5 + 0.2)
    min_ps = torch.where(torch.arange(rows) % 4 == 0, torch.full((rows,), 0.05), torch.zeros(rows))
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    return logits, inv_temps, min_ps, uniforms


# fp32 exp and running sums stay within ~1e-7 of the float64 cdf's total; ten times that is "rounding".
BOUNDARY_EPS = 1e-6


def exact_cdf(logits: torch.Tensor, inv_temps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """The float64 cumulative probabilities of each row, min_p applied, unnormalised."""
    logits = logits.double()
    probs = ((logits - logits.amax(-1, keepdim=True)) * inv_temps.double()[:, None]).exp()
    probs[probs < min_ps.double()[:, None]] = 0.0
    return probs.cumsum(-1)


def off_boundary_mismatches(tokens: torch.Tensor, want: torch.Tensor, cdf: torch.Tensor,
                            uniforms: torch.Tensor) -> list[int]:
    """Rows whose tokens differ although the draw is not within rounding of every cdf step between them."""
    total = cdf[:, -1]
    draws = uniforms * total
    bad = []
    for row in (tokens != want).nonzero().flatten().tolist():
        low, high = sorted((int(tokens[row]), int(want[row])))
        gap = (cdf[row, low:high] - draws[row]).abs().max() / total[row]
        if gap > BOUNDARY_EPS:
            bad.append(row)
    return bad


def test_native_draw_picks_the_reference_token_and_normaliser():
    args = make_rows(rows=512)
    tokens, lse = cpu.sample_from_logits(*args)
    want_tokens, want_lse = reference.sample_from_logits(*args)
    logits, inv_temps, min_ps, uniforms = args
    # A different token is allowed only where the uniform sits within float rounding of a cdf step.
    assert off_boundary_mismatches(tokens, want_tokens, exact_cdf(logits, inv_temps, min_ps), uniforms) == []
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


def test_a_draw_on_a_cdf_step_may_land_either_side_but_one_off_it_may_not():
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.25, 0.25, 0.5]]))
    cdf = exact_cdf(logits, torch.ones(2), torch.zeros(2))
    uniforms = torch.tensor([0.5, 0.4], dtype=torch.float64)
    assert off_boundary_mismatches(torch.tensor([1, 1]), torch.tensor([2, 1]), cdf, uniforms) == []
    assert off_boundary_mismatches(torch.tensor([1, 1]), torch.tensor([1, 2]), cdf, uniforms) == [1]


def test_native_draw_never_picks_a_masked_or_min_p_excluded_token():
    logits, inv_temps, min_ps, _ = make_rows(rows=256, vocab=500, seed=1)
    uniforms = torch.linspace(0, 1, 256, dtype=torch.float64).clamp(max=1 - 1e-12)
    tokens, _ = cpu.sample_from_logits(logits, inv_temps, min_ps, uniforms)
    chosen = logits.gather(1, tokens[:, None]).squeeze(1)
    assert torch.isfinite(chosen).all()
    probs = ((chosen - logits.amax(-1)) * inv_temps).exp()
    assert (probs >= min_ps).all()


def test_native_draw_follows_the_distribution_quantile_by_quantile():
    logits = torch.log(torch.tensor([0.1, 0.0, 0.25, 0.05, 0.6]))[None].repeat(1000, 1)
    uniforms = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    tokens, lse = cpu.sample_from_logits(logits, torch.ones(1000), torch.zeros(1000), uniforms)
    counts = torch.bincount(tokens, minlength=5)
    assert counts.tolist() == [100, 0, 250, 50, 600]
    torch.testing.assert_close(lse, torch.zeros(1000), atol=1e-6, rtol=0)


def test_native_logsumexp_equals_torch():
    logits, *_ = make_rows(rows=16, vocab=49152, seed=2)
    torch.testing.assert_close(cpu.logsumexp(logits), torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-6)


def test_a_row_with_nothing_to_sample_is_refused():
    logits = torch.full((2, 8), -float("inf"))
    logits[0, 3] = 1.0
    with pytest.raises(ValueError, match="no finite value"):
        cpu.sample_from_logits(logits, torch.ones(2), torch.zeros(2), torch.full((2,), 0.5, dtype=torch.float64))


def test_logits_widen_from_bf16_exactly(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    x = (torch.randn(5, 1000) * 30).to(torch.bfloat16)
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    got = to_float32(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float(), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 1000, 49152])
def test_native_argmax_equals_torch_on_ties_nan_and_masked_rows(vocab):
    logits, *_ = make_rows(rows=6, vocab=vocab, seed=3)
    logits[1] = 0.0  # all tied: the first index
    logits[2, vocab // 2] = logits[2, -1] = logits[2].max() + 1  # a tie for the top: the earlier one
    logits[3] = -float("inf")  # fully masked
    logits[4, -1] = float("nan")  # NaN wins wherever it is, as in torch
    logits[5, vocab // 3 :] = float("nan")
    assert torch.equal(cpu.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(reference.argmax(logits), logits.argmax(dim=-1))
