"""Shared fixtures: tiny random-weight models the tests make, free loopback ports, and transformers as the
oracle (greedy tokens and their fp32 logprobs for one prompt alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.testing import make_tiny_model

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 with QKV bias."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_mistral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mistral (no sliding window), saved as a sharded checkpoint with an index file."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=2, max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_tied_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose lm_head is tied to the input embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied"), "llama", tie_word_embeddings=True, seed=3)


@pytest.fixture(scope="session")
def tiny_llama3_rope_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with llama3 rope scaling whose original context (64) is shorter than the test prompts."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama3-rope"), "llama", rope_scaling=LLAMA3_ROPE_SCALING, seed=4
    )


@pytest.fixture(scope="session")
def tiny_linear_rope_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 with linear rope scaling (positions divided by 4)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-linear-rope"),
        "qwen2",
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        seed=5,
    )


class HFReference:
    """Caches one transformers model per folder and answers greedy continuations."""

    def __init__(self) -> None:
        self._models: dict[Path, torch.nn.Module] = {}

    def model(self, path: Path) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if path not in self._models:
            self._models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return self._models[path]

    def greedy(self, path: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens (eos ignored) and the fp32 logprob of each."""
        out = self.model(path).generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        logprobs = [
            torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)
        ]
        return tokens, logprobs

    def prompt_logprobs(self, path: Path, prompt_ids: list[int]) -> list[float]:
        """logprob of prompt token i+1 given tokens 0..i, for each i."""
        with torch.no_grad():
            logits = self.model(path)(torch.tensor([prompt_ids])).logits[0].float()
        lps = torch.log_softmax(logits[:-1], -1)
        return lps.gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1).tolist()


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    """A session-wide transformers oracle."""
    return HFReference()
