"""The request fields that edit logits before penalties and sampling: allowed_token_ids, bad_words and
logit_bias (vLLM's order), row by row over the rows that use them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.backend.core.request import Request


def apply_logits_processors(logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, set[int]]:
    """(logits with each row's processors applied, the rows changed); `logits` itself is left alone."""
    rows = [i for i, r in enumerate(requests) if _uses_processors(r)]
    if not rows:
        return logits, set()
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        params = requests[i].sampling_params
        if params.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            keep[params.allowed_token_ids] = True
            _mask_unless_empty(logits[i], ~keep)
        banned = _banned_now(params.bad_words_token_ids, requests[i].output_token_ids)
        if banned:
            drop = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            drop[banned] = True
            _mask_unless_empty(logits[i], drop)
        if params.logit_bias:
            ids = list(params.logit_bias)
            logits[i, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype,
                                           device=logits.device)
    return logits, set(rows)


def _mask_unless_empty(row: torch.Tensor, drop: torch.Tensor) -> None:
    """-inf where `drop`, unless that leaves no token: a mask that conflicts with an earlier one (the grammar's,
    then allowed_token_ids) yields to it for this step, so the row can still be sampled."""
    masked = row.masked_fill(drop, -float("inf"))
    if bool(masked.isfinite().any()):
        row.copy_(masked)


def _uses_processors(request: Request) -> bool:
    params = request.sampling_params
    return bool(params.allowed_token_ids or params.bad_words_token_ids or params.logit_bias)


def _banned_now(sequences: list[list[int]], output: Sequence[int]) -> list[int]:
    """The last token of each bad-word sequence whose other tokens end the output so far."""
    banned = []
    for seq in sequences:
        prefix = seq[:-1]
        if not prefix or (len(output) >= len(prefix) and list(output[len(output) - len(prefix):]) == prefix):
            banned.append(seq[-1])
    return banned
