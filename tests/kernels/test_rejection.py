"""Rejection sampling of drafts: the torch reference's outputs follow the target distribution exactly
(chi-square over many seeded draws, for several p/q pairs), and the Triton kernel under the interpreter
gives the reference's tokens."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.rejection import reference
from pagedserve.kernels.rejection import triton as rejection_triton

CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # quantile 0.999 by dof
VOCAB = 8
P = torch.tensor([0.3, 0.05, 0.15, 0.1, 0.2, 0.05, 0.15, 0.0])
PAIRS = {
    "q=p": (P, P),
    "disjoint": (torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0]), torch.tensor([0, 0, 0, 0, 0.25, 0.25, 0.4, 0.1])),
    "overlap": (P, torch.tensor([0.05, 0.4, 0.05, 0.3, 0.05, 0.05, 0.0, 0.1])),
    "q peaked": (P, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])),
    "point mass": (P, None),
}


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the token counts over the support of `probs` (nothing may fall outside it)."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0, counts
    expected = probs[support].double() * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def _batch(p: torch.Tensor, q: torch.Tensor | None, rows: int, seed: int, point_draft: int = 0):
    """`rows` sequences of two drafts drawn from q (or, for a point mass, fixed), p at every position."""
    gen = torch.Generator().manual_seed(seed)
    if q is None:
        drafts = torch.tensor([[point_draft, 1]] * rows)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, rows * 2, replacement=True, generator=gen).view(rows, 2)
        draft_probs = q.expand(rows, 2, VOCAB).contiguous()
    target = p.expand(rows, 3, VOCAB).contiguous()
    uniforms = torch.rand(rows, 3, generator=gen, dtype=torch.float64)
    return drafts, torch.full((rows,), 2), draft_probs, target, uniforms


@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_reference_output_follows_the_target_distribution(pair):
    p, q = PAIRS[pair]
    rows = 20000
    out = reference.rejection_sample(*_batch(p, q, rows, seed=len(pair)))
    # Every position's token, given the run reached it, is distributed as p: the first always, the second
    # where the first draft was accepted.
    stat, dof = chi_square(out[:, 0], p)
    assert stat < CHI2_999[dof], (pair, stat)
    reached = out[:, 1] >= 0
    if reached.sum() > 1000:
        stat, dof = chi_square(out[reached, 1], p)
        assert stat < CHI2_999[dof], (pair, stat)
    if pair == "q=p":
        assert bool((out[:, 2] >= 0).all())  # q = p accepts everything: u * q < p for every u < 1
    if pair == "disjoint":
        assert bool((out[:, 1] == -1).all())  # q's drafts have p = 0: always rejected at once


def test_point_mass_accepts_with_probability_p_of_the_draft():
    for draft in (0, 4, 7):
        out = reference.rejection_sample(*_batch(P, None, 20000, seed=draft, point_draft=draft))
        accepted = float((out[:, 0] == draft).double().mean())
        assert abs(accepted - float(P[draft])) < 0.015, draft
        stat, dof = chi_square(out[:, 0], P)
        assert stat < CHI2_999[dof], (draft, stat)


def _random_case(batch: int, k: int, vocab: int, with_q: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, dim=-1)
    target[0, :, vocab // 2 :] = 0  # a row with a zero tail
    target[0] /= target[0].sum(-1, keepdim=True)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, dim=-1) if with_q else None
    if with_q:
        draft_probs[1] = target[1, :k]  # q = p: all accepted
        drafts = torch.stack([torch.multinomial(draft_probs[b], 1, generator=gen).squeeze(1) for b in range(batch)])
    else:
        drafts = torch.randint(0, vocab, (batch, k), generator=gen)
        drafts[1] = target[1, :k].argmax(-1)  # likely accepted
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    num_drafts[1] = k
    uniforms = torch.rand(batch, k + 1, generator=gen, dtype=torch.float64)
    return drafts, num_drafts, draft_probs, target, uniforms


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "point-mass"])
@pytest.mark.parametrize(("k", "vocab"), [(1, 37), (4, 1000), (3, 2500)])  # one tile; one; three of 1024
def test_triton_equals_reference(with_q, k, vocab):
    case = _random_case(6, k, vocab, with_q, seed=k * vocab)
    want = reference.rejection_sample(*case)
    got = rejection_triton.rejection_sample(*case)
    assert torch.equal(got, want), (got, want)
    if with_q:
        assert bool((want[1] >= 0).all())  # q = p: the row reached its bonus token


def test_no_drafts_draws_the_bonus_token_from_the_first_row():
    target = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    for impl in (reference, rejection_triton):
        out = impl.rejection_sample(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                                    None, target, torch.rand(2, 1, dtype=torch.float64))
        assert out.tolist() == [[1], [2]], impl
