"""One step's sampling with draft tokens in it. A draft from the n-gram proposer is a point mass q = 1 at
the draft token d, so rejection sampling (accept with min(1, p/q), else draw from normalised max(0, p - q))
reduces to: draw from the target p at each draft position and accept while the draw equals the draft.
P(accept) = p(d), and a rejected position's draw is distributed as p without d, normalised: exactly the
residual. Each position's p is what plain sampling would draw from once the drafts before it were output
(penalties, min_tokens, bad words and the grammar mask see them), and it draws with the uniform plain
sampling would use there, so seeded outputs equal those without speculation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.backend.core.request import RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import SchedulerOutput
from pagedserve.backend.engine.request_group import SequenceState, StepBatch
from pagedserve.backend.structured import StructuredOutputs
from pagedserve.backend.worker.sampler import Sampler, SamplerOutput

# A verified run of one sequence: (token id, its logprob, top logprobs), in output order.
Run = list[tuple[int, float, dict[int, float] | None]]


@dataclass
class DraftPosition:
    """A request as the sampler sees it at one draft position: its outputs followed by the drafts before it."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class StepSample:
    """What a step sampled: one entry per batch row (a speculating row's is its run's last token), the
    accepted draft count and run of each speculating request, and the scheduled draft count of each."""

    sampled: SamplerOutput
    num_accepted: dict[str, int]
    runs: dict[str, Run]
    num_drafts: dict[str, int]


def sample_step(
    sampler: Sampler, structured: StructuredOutputs | None, logits: torch.Tensor, batch: StepBatch,
    sched: SchedulerOutput, spec_logits: dict[str, torch.Tensor],
) -> StepSample | None:
    """Sample every row of `logits` [R, V] (batch order); a row whose request has drafts scheduled samples
    each draft position from `spec_logits[request_id]` [k, V] and its own row, and keeps the longest run of
    draws equal to the drafts plus the next draw."""
    if not batch.requests:
        return None
    drafts = {s.request.request_id: s.spec_token_ids for s in sched.scheduled
              if s.spec_token_ids and s.request.request_id in spec_logits}
    spec_rows = [i for i, r in enumerate(batch.requests) if r.request_id in drafts]
    if not spec_rows:
        return StepSample(sampler(_masked(structured, logits, batch.matchers), batch.requests), {}, {}, {})
    plain_rows = [i for i, r in enumerate(batch.requests) if r.request_id not in drafts]
    parts = [_masked(structured, logits[plain_rows], [batch.matchers[i] for i in plain_rows])] if plain_rows else []
    rows: list[Any] = [batch.requests[i] for i in plain_rows]
    spans: list[tuple[int, int]] = []  # per speculating row: (its first position row, its usable drafts)
    for i in spec_rows:
        request = batch.requests[i]
        rid = request.request_id
        positions = torch.cat([spec_logits[rid], logits[i : i + 1]]).float()
        usable = _mask_positions(structured, positions, batch.matchers[i], drafts[rid])
        spans.append((len(rows), usable))
        parts.append(positions[: usable + 1])
        outputs = list(request.output_token_ids)
        rows += [DraftPosition(rid, request.sampling_params, request.prompt_token_ids, outputs + drafts[rid][:t])
                 for t in range(usable + 1)]
    states = _generator_states(sampler, [batch.requests[i].request_id for i in spec_rows])
    out = sampler(torch.cat(parts), rows)
    result = StepSample(SamplerOutput([0] * len(batch.requests), [0.0] * len(batch.requests),
                                      [None] * len(batch.requests)), {}, {}, {})
    for j, i in enumerate(plain_rows):
        _put(result.sampled, i, out, j)
    for i, (first, usable) in zip(spec_rows, spans, strict=True):
        rid = batch.requests[i].request_id
        draws = out.token_ids[first : first + usable + 1]
        n = next((t for t in range(usable) if draws[t] != drafts[rid][t]), usable)
        result.runs[rid] = [(draws[t], out.logprobs[first + t], out.top_logprobs[first + t]) for t in range(n + 1)]
        result.num_accepted[rid], result.num_drafts[rid] = n, len(drafts[rid])
        _put(result.sampled, i, out, first + n)
        _rewind(sampler, rid, states.get(rid), n + 1)
    return result


def _masked(structured: StructuredOutputs | None, logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """`logits` [R, V] masked by each row's grammar; as they are where the engine has no structured outputs."""
    return logits if structured is None else structured.apply(logits, matchers)


def _put(dst: SamplerOutput, i: int, src: SamplerOutput, j: int) -> None:
    dst.token_ids[i], dst.logprobs[i], dst.top_logprobs[i] = src.token_ids[j], src.logprobs[j], src.top_logprobs[j]


def _mask_positions(structured: StructuredOutputs | None, positions: torch.Tensor, matcher: Any,
                    drafts: list[int]) -> int:
    """Mask each position row of `positions` [k + 1, V] in place with the grammar state after the drafts
    before it; returns how many drafts the grammar allows (the positions after a disallowed draft, whose p
    is 0, cannot be reached). The matcher is rolled back to where it was."""
    if matcher is None:
        return len(drafts)
    advanced = 0
    for t in range(len(drafts) + 1):
        if matcher.is_terminated():
            break  # the sequence ends with the draft before: this position's draw is never output
        positions[t : t + 1] = _masked(structured, positions[t : t + 1], [matcher])
        if t == len(drafts) or not matcher.accept_token(drafts[t]):
            break
        advanced += 1
    if advanced:
        matcher.matcher.rollback(advanced)
    return advanced


def _generator_states(sampler: Sampler, request_ids: Sequence[str]) -> dict[str, torch.Tensor]:
    """Each seeded request's generator state before the step draws its positions."""
    states = {}
    for rid in request_ids:
        gen = sampler.generator(rid)
        if gen is not None:
            states[rid] = gen.get_state()
    return states


def _rewind(sampler: Sampler, request_id: str, state: torch.Tensor | None, num_used: int) -> None:
    """Leave a seeded request's generator as if it had drawn for its `num_used` output tokens only (one
    uniform each, as plain sampling does), not for the positions after a rejection."""
    gen = sampler.generator(request_id)
    if state is None or gen is None or torch.equal(gen.get_state(), state):
        return  # unseeded, or it drew nothing (greedy)
    gen.set_state(state)
    for _ in range(num_used):
        torch.rand(1, generator=gen, device=gen.device, dtype=torch.float64)


def record_run(
    seq: SequenceState, run: Run,
    record: Callable[[SequenceState, int, float, dict[int, float] | None], RequestStatus | None],
) -> RequestStatus | None:
    """Record a verified run token by token, as if each had been sampled alone; stop where one stops it
    (the tokens after it are dropped). The scheduler appended the whole run, so it is taken off first."""
    request = seq.request
    del request.output_token_ids[-len(run) :], request.all_token_ids[-len(run) :]
    for token, logprob, top in run:
        request.append_output_token_id(token)
        status = record(seq, token, logprob, top)
        if status is not None:
            return status
    return None
