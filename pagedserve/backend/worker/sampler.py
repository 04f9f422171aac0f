"""Batched token sampling: penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve import kernels
from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.worker.logits_processors import apply_logits_processors

# Below this temperature the scaled logits overflow; such rows are sampled greedily, as vLLM does.
_TEMPERATURE_EPS = 1e-5


@dataclass
class SamplerOutput:
    """One sampled token per row, its raw logprob, and the top-N logprobs where asked for.

    A `top_logprobs` dict holds the N most likely tokens plus the chosen one (vLLM's convention).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], num_top: int
) -> tuple[list[float], list[dict[int, float]]]:
    """Log-softmax logprobs of `token_ids` (one per row) and, per row, the top `num_top` plus that token.

    Used for prompt logprobs (row t scores prompt token t+1) and for beam-search expansion.
    """
    # logits: [T, V]; token_ids: [T]
    logits = logits.float()
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
    lse = torch.logsumexp(logits, dim=-1)
    chosen = (logits.gather(1, ids[:, None]).squeeze(1) - lse).tolist()
    if num_top <= 0:
        return chosen, [{tok: lp} for tok, lp in zip(ids.tolist(), chosen, strict=True)]
    top_vals, top_ids = torch.topk(logits, min(num_top, logits.shape[-1]), dim=-1)
    top_vals = (top_vals - lse[:, None]).tolist()
    tops = []
    for tok, lp, ids_row, vals_row in zip(ids.tolist(), chosen, top_ids.tolist(), top_vals, strict=True):
        entry = dict(zip(ids_row, vals_row, strict=True))
        entry[tok] = lp
        tops.append(entry)
    return chosen, tops


class Sampler:
    """Samples one token per row of a logits batch; row i belongs to `requests[i]`.

    Seeded requests draw from their own `torch.Generator`, kept here until `free(request_id)`.
    """

    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = set(eos_token_ids)
        self._generators: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        """Forget the generator of a finished or aborted request (no-op when it has none)."""
        self._generators.pop(request_id, None)

    def generator(self, request_id: str) -> torch.Generator | None:
        """The generator of a seeded request once it has drawn (speculation rewinds it), else None."""
        return self._generators.get(request_id)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Sample for every row; one host sync at the end."""
        # logits: [R, V]
        if logits.shape[0] != len(requests):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(requests)} requests")
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        adjusted, processed_rows = apply_logits_processors(logits, requests)
        adjusted, banned_rows = self._apply_min_tokens(adjusted, requests)
        banned_rows |= processed_rows
        adjusted = apply_penalties(adjusted, requests)

        random_rows = [i for i, p in enumerate(params) if p.temperature >= _TEMPERATURE_EPS]
        lse = torch.empty(len(requests), device=logits.device)
        have_lse = [False] * len(requests)
        if len(random_rows) == len(requests):
            chosen, sampled_lse = self._sample_random(adjusted, requests)
            rows = list(range(len(requests)))
        else:
            chosen = kernels.argmax(adjusted)
            rows = random_rows
            if random_rows:
                index = torch.tensor(random_rows, device=logits.device)
                chosen[index], sampled_lse = self._sample_random(
                    adjusted[index], [requests[i] for i in random_rows]
                )
        # Where the sampled distribution is the model's own, its normaliser is the raw one: no second pass.
        same = [j for j, i in enumerate(rows) if i not in banned_rows and _samples_raw_distribution(params[i])]
        if same:
            lse[[rows[j] for j in same]] = sampled_lse[same]
            for j in same:
                have_lse[rows[j]] = True
        missing = [i for i, ok in enumerate(have_lse) if not ok]
        if len(missing) == len(requests):  # an all-greedy batch: no [R, V] copy of the rows
            lse = kernels.logsumexp(logits)
        elif missing:
            lse[missing] = kernels.logsumexp(logits[missing])

        chosen_logprobs = logits.gather(1, chosen[:, None]).squeeze(1) - lse
        top_logprobs = _top_logprobs(logits, lse, chosen, params)
        return SamplerOutput(chosen.tolist(), chosen_logprobs.tolist(), top_logprobs)

    def _apply_min_tokens(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, set[int]]:
        """Until min_tokens outputs exist, no token that would end the request may be drawn."""
        banned: list[tuple[int, int]] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if len(r.output_token_ids) >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stops |= self.eos_token_ids
            banned.extend((i, t) for t in stops if 0 <= t < logits.shape[1])
        if not banned:
            return logits, set()
        logits = logits.clone()
        rows, cols = zip(*banned, strict=True)
        touched = sorted(set(rows))
        before = logits[touched]
        logits[list(rows), list(cols)] = -float("inf")
        alive = logits[touched].isfinite().any(dim=1).tolist()
        dead = [k for k, ok in enumerate(alive) if not ok]
        if dead:
            # A row left with no token (its grammar allows only its end) keeps its stop tokens: the grammar wins.
            logits[[touched[k] for k in dead]] = before[dead]
        return logits, {touched[k] for k, ok in enumerate(alive) if ok}

    def _sample_random(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; also return each row's logsumexp of the (scaled, masked) logits."""
        # logits: [S, V] of the rows with temperature > 0
        params = [r.sampling_params for r in requests]
        device = logits.device
        temps = [p.temperature for p in params]
        inv_temp = None
        if any(t != 1.0 for t in temps):
            inv_temp = 1.0 / torch.tensor(temps, device=device)[:, None]
        logits = _apply_top_k_top_p(logits, params, inv_temp)
        inv_temps = torch.ones(len(params), device=device) if inv_temp is None else inv_temp.squeeze(1)
        min_ps = torch.tensor([max(p.min_p, 0.0) for p in params], device=device)
        return kernels.sample_from_logits(logits, inv_temps, min_ps, self._uniforms(requests, device))

    def _uniforms(self, requests: Sequence[Request], device: torch.device) -> torch.Tensor:
        """One uniform per row for the inverse-CDF draw (instead of one random number per vocab entry)."""
        uniforms = torch.rand(len(requests), device=device, dtype=torch.float64)
        for row, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                # A seeded row draws from its own generator only, so other rows cannot shift its stream.
                uniforms[row] = torch.rand(1, generator=self._generator(r, device), device=device,
                                           dtype=torch.float64)
        return uniforms

    def _generator(self, request: Request, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(request.sampling_params.seed)
            self._generators[request.request_id] = gen
        return gen


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Repetition (HF: prompt + output tokens) then presence/frequency (OpenAI: output tokens)."""
    rep_rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
    pf_rows = [
        i
        for i, r in enumerate(requests)
        if r.sampling_params.presence_penalty != 0.0 or r.sampling_params.frequency_penalty != 0.0
    ]
    if not rep_rows and not pf_rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    if rep_rows:
        seen = _token_counts([list(requests[i].prompt_token_ids) + list(requests[i].output_token_ids)
                              for i in rep_rows], vocab, logits.device) > 0
        penalty = torch.tensor([requests[i].sampling_params.repetition_penalty for i in rep_rows],
                               device=logits.device)[:, None]
        rows = logits[rep_rows]
        penalised = torch.where(rows > 0, rows / penalty, rows * penalty)
        logits[rep_rows] = torch.where(seen, penalised, rows)
    if pf_rows:
        counts = _token_counts([list(requests[i].output_token_ids) for i in pf_rows], vocab, logits.device)
        freq = torch.tensor([requests[i].sampling_params.frequency_penalty for i in pf_rows],
                            device=logits.device)[:, None]
        presence = torch.tensor([requests[i].sampling_params.presence_penalty for i in pf_rows],
                                device=logits.device)[:, None]
        logits[pf_rows] -= counts * freq + (counts > 0).float() * presence
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each vocab id per row: [len(token_lists), vocab] float."""
    width = max((len(t) for t in token_lists), default=0)
    # Padding points at an extra column that is dropped, so rows of any length scatter in one op.
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.long)
    for row, toks in enumerate(token_lists):
        if toks:
            padded[row, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _samples_raw_distribution(p: SamplingParams) -> bool:
    """True when sampling draws from the model's unmodified softmax (no temperature, masks, penalties)."""
    return (
        p.temperature == 1.0
        and (not p.top_k or p.top_k <= 0)
        and p.top_p >= 1.0
        and p.min_p <= 0.0
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )


def _apply_top_k_top_p(
    logits: torch.Tensor, params: Sequence[SamplingParams], inv_temp: torch.Tensor | None = None
) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p (over the top-k-renormalised distribution at the row's
    temperature, `inv_temp` = 1/T per row or None for all 1), exclude."""
    # logits: [S, V]
    vocab = logits.shape[1]
    ks = [p.top_k if p.top_k and p.top_k > 0 else vocab for p in params]
    ks = [min(k, vocab) for k in ks]
    top_ps = [p.top_p for p in params]
    use_top_p = any(tp < 1.0 for tp in top_ps)
    if not use_top_p:
        if all(k == vocab for k in ks):
            return logits
        # Top-k alone needs only the k-th largest value per row, not a full sort.
        k = torch.tensor(ks, device=logits.device)
        top_vals = torch.topk(logits, max(ks), dim=-1).values
        kth = top_vals.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, -float("inf"))
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=logits.device)
    k = torch.tensor(ks, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(positions[None, :] >= k[:, None], -float("inf"))
    sorted_probs = torch.softmax(sorted_logits if inv_temp is None else sorted_logits * inv_temp, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = torch.tensor(top_ps, device=logits.device)
    # Keep a token while the mass ahead of it is below top_p; rows with top_p == 1 keep all.
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    outside[:, 0] = False  # the most likely token always stays, however small top_p (it may round to 0.0)
    sorted_logits = sorted_logits.masked_fill(outside, -float("inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _top_logprobs(
    logits: torch.Tensor, lse: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams]
) -> list[dict[int, float] | None]:
    """Top-N raw logprobs plus the chosen token for rows with `logprobs` > 0, else None."""
    wanted = [p.logprobs or 0 for p in params]
    result: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, n in enumerate(wanted) if n > 0]
    if not rows:
        return result
    num_top = max(wanted[i] for i in rows)
    _, tops = compute_logprobs(logits[rows], chosen[rows], num_top)
    for row, top in zip(rows, tops, strict=True):
        n = wanted[row]
        ranked = sorted(top.items(), key=lambda kv: kv[1], reverse=True)
        entry = dict(ranked[:n])
        tok = int(chosen[row])
        entry[tok] = top[tok]
        result[row] = entry
    return result
