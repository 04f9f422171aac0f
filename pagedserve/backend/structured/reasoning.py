"""Constraints after thinking, as vLLM applies them: a sequence whose request names its reasoning's end
marker (`reasoning_end_token_ids`, sent by the OpenAI shim's reasoning parser) samples freely until the
marker has been generated, and only then does its grammar (if any) start matching. A thinking budget
(`thinking_token_budget`, vLLM's name) forces the marker, token by token, once that many tokens were thought.

`ReasoningGate` stands where a `GrammarState` stands (the step's bitmask, the output processor's accept
and stop checks, the draft verifier's rollback), so nothing else in the engine knows about reasoning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Snapshot:
    answering: bool
    thought: int
    tail: tuple[int, ...]
    inner_accepted: bool  # the token went to the grammar (to roll back there too)


class ReasoningGate:
    """One sequence's thinking then answering; `inner` is the grammar of the answer (None: unconstrained)."""

    def __init__(self, end_token_ids: list[int], budget: int | None, inner: Any = None):
        self._end = tuple(end_token_ids)
        self._budget = budget
        self._inner = inner
        self.answering = False
        self.thought = 0  # tokens generated while thinking, the end marker's included
        self._tail: tuple[int, ...] = ()  # the newest thinking tokens, as many as the marker has
        self._history: list[_Snapshot] = []

    @property
    def matcher(self) -> ReasoningGate:
        """What the step's bitmask and the verifier's rollback call (a GrammarState's xgrammar matcher)."""
        return self

    @property
    def ban_control_bytes(self) -> bool:
        return self.answering and self._inner is not None and self._inner.ban_control_bytes

    def _forced(self) -> int | None:
        """The marker token the budget forces next, if it does."""
        if self.answering or self._budget is None:
            return None
        if self.thought < self._budget:
            return None
        # Forcing started at the budget: the marker tokens written since then are a head of the marker.
        written = min(self.thought - self._budget, len(self._end) - 1)
        return self._end[written]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an xgrammar bitmask [R, ceil(V / 32)] int32: what this sequence may sample next."""
        forced = self._forced()
        if forced is not None:
            bitmask[row] = 0
            bitmask[row, forced // 32] = _bit(forced % 32)
        elif self.answering and self._inner is not None:
            self._inner.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = -1

    def accept_token(self, token_id: int) -> bool:
        """Record a sampled token; the answer's tokens go to the grammar."""
        if self.answering:
            accepted = self._inner.accept_token(token_id) if self._inner is not None else True
            self._history.append(_Snapshot(True, self.thought, self._tail, self._inner is not None))
            return accepted
        self._history.append(_Snapshot(False, self.thought, self._tail, False))
        self.thought += 1
        self._tail = (*self._tail, token_id)[-len(self._end):]
        self.answering = self._tail == self._end
        return True

    def is_terminated(self) -> bool:
        return self.answering and self._inner is not None and self._inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected drafts)."""
        if num_tokens <= 0:
            return
        undone = self._history[len(self._history) - num_tokens:]
        del self._history[len(self._history) - num_tokens:]
        inner_tokens = sum(snapshot.inner_accepted for snapshot in undone)
        if inner_tokens:
            self._inner.matcher.rollback(inner_tokens)
        first = undone[0]
        self.answering, self.thought, self._tail = first.answering, first.thought, first.tail


def _bit(position: int) -> int:
    """The int32 word with only bit `position` set."""
    return -(1 << 31) if position == 31 else 1 << position
