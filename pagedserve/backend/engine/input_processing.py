"""Turning a user request into what the scheduler takes: the prompt's token ids, and the checks that
depend on the model and the engine's limits."""

from __future__ import annotations

from pagedserve.backend.core.config import CacheConfig
from pagedserve.backend.core.errors import InvalidRequestError
from pagedserve.backend.core.logits_params import check_token_ids_in_vocab
from pagedserve.backend.core.request import Request
from pagedserve.backend.core.sampling_params import SamplingParams
from pagedserve.backend.engine.detokenizer import Tokenizer


def resolve_prompt(tokenizer: Tokenizer, vocab_size: int, prompt: str | None,
                     token_ids: list[int] | None, add_special_tokens: bool = True) -> list[int]:
    """The prompt's token ids, from the ids when given, else by tokenizing the text."""
    if token_ids is not None:
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise InvalidRequestError("prompt_token_ids must be a non-empty list of token ids", "prompt_token_ids")
        for tok in token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
                raise InvalidRequestError(
                    f"prompt_token_ids entries must be integers in [0, {vocab_size}), got {tok!r}",
                    "prompt_token_ids",
                )
        return list(token_ids)
    if prompt is None:
        raise InvalidRequestError("one of prompt or prompt_token_ids is required", "prompt")
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if not ids:
        raise InvalidRequestError("prompt tokenizes to no tokens", "prompt")
    return ids


def truncate_prompt(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens, as vLLM keeps them; -1 keeps as many as leave room
    for one new token."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return token_ids
    return token_ids[-(max_model_len - 1 if keep == -1 else keep):]


def check_params(params: SamplingParams, max_num_seqs: int) -> None:
    """Refuse what the engine cannot run: more sequences than run at once, beam search with features it
    does not combine with."""
    width, field = (params.beam_width, "beam_width") if params.beam_width > 1 else (params.n, "n")
    if width > max_num_seqs:
        # Its sequences all run at once (they fork at the first token).
        raise InvalidRequestError(f"{field} must be <= max_num_seqs ({max_num_seqs}), got {width}", field)
    if params.beam_width > 1:
        for name in ("stop", "prompt_logprobs", "structured_outputs", "reasoning_end_token_ids"):
            if getattr(params, name):
                raise InvalidRequestError(f"{name} is not supported with beam search (beam_width > 1)", name)


def resolve_logits_params(tokenizer: Tokenizer, vocab_size: int, params: SamplingParams) -> None:
    """Check the token ids of logit_bias and allowed_token_ids against the vocabulary, and tokenize
    bad_words: each word alone and after a space (how it reads mid-text), as vLLM does."""
    check_token_ids_in_vocab("logit_bias", params.logit_bias, vocab_size)
    check_token_ids_in_vocab("allowed_token_ids", params.allowed_token_ids, vocab_size)
    check_token_ids_in_vocab("reasoning_end_token_ids", params.reasoning_end_token_ids, vocab_size)
    sequences: list[list[int]] = []
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    params.bad_words_token_ids = sequences


def check_priority_policy(priority: int, policy: str) -> None:
    """As vLLM: a priority the waiting queue would not honour is refused, not dropped."""
    if priority and policy != "priority":
        raise InvalidRequestError(f"priority {priority} needs the priority scheduling policy (this engine "
                                  f"schedules {policy})", "priority")


def check_beams_fit(request: Request, cache_config: CacheConfig, num_blocks: int) -> None:
    """All beams live at once, so the pool must hold the shared prompt plus every beam's own tail."""
    block_size = cache_config.block_size
    shared = request.num_prompt_tokens // block_size
    per_beam = -(-(request.num_prompt_tokens + request.max_tokens) // block_size) - shared
    needed = shared + request.sampling_params.beam_width * per_beam
    if needed > num_blocks:
        raise InvalidRequestError(
            f"beam_width {request.sampling_params.beam_width} with max_tokens {request.max_tokens} needs "
            f"{needed} KV blocks, more than the whole cache ({num_blocks} blocks)",
            "beam_width",
        )
