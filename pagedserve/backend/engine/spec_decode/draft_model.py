"""Draft-model speculation: a small model with the target's tokenizer proposes each sequence's next tokens
greedily (a point mass, so verify.py's verification stays exact for every request). It runs through its
own ModelRunner on a KV cache indexed by the target's block ids: it executes every target step too, so a
block holds the draft's KV for the same tokens as the target's, and allocation, freeing, preemption and
prefix hits need nothing of their own. Proposal steps write past the computed tokens into scratch blocks
beyond the target's, starting from a copy of the sequence's partial last block, so real blocks (a forked
sibling may share one) are never touched by a guess."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.backend.core.errors import ConfigError
from pagedserve.backend.core.request import Request, RequestStatus
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.backend.engine.spec_decode.ngram import NgramSpeculator, can_speculate
from pagedserve.backend.worker.model_runner import ModelRunner


@dataclass
class _DraftView:
    """A sequence as a proposal step feeds it to the draft runner: its tokens followed by the drafts so far."""

    request_id: str
    sampling_params: SamplingParams
    num_prompt_tokens: int
    all_token_ids: list[int]
    pooling_params: None = None  # a draft step samples every row it is given, never pools one


class DraftModelSpeculator(NgramSpeculator):
    """Proposes with a draft model before each schedule(); `observe` runs the draft on each target step."""

    def __init__(self, config: Any, engine: Any) -> None:
        super().__init__(config, engine.scheduler_config.max_model_len)
        target = engine.runner
        self.block_manager = engine.scheduler.block_manager
        self.block_size = target.block_size
        self.num_target_blocks = target.num_blocks
        self.scratch_per_seq = 2 + config.num_speculative_tokens // self.block_size
        max_seqs = engine.scheduler_config.max_num_seqs
        cache = dataclasses.replace(engine.cache_config,
                                    num_blocks=self.num_target_blocks + max_seqs * self.scratch_per_seq)
        model = dataclasses.replace(engine.model_config, model=config.model, quantization="none")
        self.runner = ModelRunner(model, cache, engine.scheduler_config)
        if self.runner.arch.vocab_size != engine.vocab_size:
            raise ConfigError(
                f"speculative_config.model has a vocabulary of {self.runner.arch.vocab_size} tokens, the target "
                f"{engine.vocab_size}: a draft model must share the target's tokenizer", "speculative_config.model")

    def observe(self, sched: SchedulerOutput) -> None:
        """Run the draft over the step the target just ran: same tokens, same slots, same block copies."""
        self.runner.execute(sched)

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of each running, decoding request that can speculate: the draft's greedy
        continuation, up to num_speculative_tokens and the room max_tokens and max_model_len leave."""
        cfg = self.config
        disabled = cfg.disable_by_batch_size is not None and len(running) >= cfg.disable_by_batch_size
        todo: list[tuple[Request, int]] = []
        for request in running:
            request.spec_token_ids = []
            if disabled or request.status != RequestStatus.RUNNING:
                continue
            if request.num_tokens - request.num_computed_tokens != 1 or not can_speculate(request):
                continue
            room = min(request.max_tokens - request.num_output_tokens,
                       self.max_model_len - request.num_tokens) - 1
            if room >= 1:
                todo.append((request, min(cfg.num_speculative_tokens, room)))
        if todo:
            self._draft(todo)

    def _draft(self, todo: list[tuple[Request, int]]) -> None:
        """One batched one-token draft forward per draft position, each sequence's drafts in scratch blocks."""
        bs = self.block_size
        views, tables, copies = [], [], []
        for i, (request, _) in enumerate(todo):
            table = self.block_manager.block_tables[request.request_id]
            start = request.num_tokens - 1  # the newest token: no KV yet in either cache
            scratch = [self.num_target_blocks + i * self.scratch_per_seq + j for j in range(self.scratch_per_seq)]
            if start % bs:
                copies.append((table[start // bs], scratch[0]))
            tables.append(table[: start // bs] + scratch)
            views.append(_DraftView(request.request_id, request.sampling_params, request.num_prompt_tokens,
                                    list(request.all_token_ids)))
        for step in range(max(k for _, k in todo)):
            active = [i for i, (_, k) in enumerate(todo) if step < k]
            sched = SchedulerOutput(
                scheduled=[ScheduledRequest(views[i], 1, len(views[i].all_token_ids) - 1, tables[i], [], True)
                           for i in active],
                block_copies=copies if step == 0 else [])
            out = self.runner.execute(sched)
            for i, token in zip(active, out.sample_logits.argmax(dim=-1).tolist(), strict=True):
                views[i].all_token_ids.append(token)
        for (request, k), view in zip(todo, views, strict=True):
            request.spec_token_ids = view.all_token_ids[request.num_tokens : request.num_tokens + k]
