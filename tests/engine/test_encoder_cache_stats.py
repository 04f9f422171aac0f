"""The encoder cache's counters behind vLLM's vllm:mm_cache_queries / vllm:mm_cache_hits (EngineStats): an image a
request reaches is one query, a hit when its embeddings were cached; an image cut by chunked prefill is one query;
queries minus hits is what the encoder ran."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pagedserve.backend.engine.llm_engine import LLMEngine
from pagedserve.testing import make_tiny_llava, tiny_image
from tests.support.engines import cpu_engine, greedy, run_to_end


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    tiny_image(24, 24, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava-mm-stats"), "clip", seed=7)


def _run(engine: LLMEngine, request_id: str, prompt: str, images: list[bytes]) -> tuple[int, int, int]:
    engine.add_request(request_id, prompt, greedy(2), images=images)
    run_to_end(engine)
    stats = engine.get_stats()
    return stats.mm_cache_queries, stats.mm_cache_hits, engine.scheduler.encoder_cache.num_encoded


def test_a_repeated_image_is_a_hit_and_another_image_a_miss(llava_path):
    engine = cpu_engine(llava_path, num_blocks=64, max_model_len=256)
    assert (engine.get_stats().mm_cache_queries, engine.get_stats().mm_cache_hits) == (0, 0)
    assert _run(engine, "a", "Describe <image> briefly.", [_png(0)]) == (1, 0, 1)
    # Other text first: no prefix-cache hit skips the image, so it is looked up, and found.
    assert _run(engine, "b", "Now say what <image> shows.", [_png(0)]) == (2, 1, 1)
    assert _run(engine, "c", "And what <image> shows.", [_png(1)]) == (3, 1, 2)
    assert _run(engine, "d", "Both <image> and <image> again.", [_png(2), _png(2)]) == (5, 2, 3)
    # The same prompt and image: the prefix cache holds the first block, the image's rest still needs its
    # embeddings, so it is looked up (and found).
    assert _run(engine, "e", "Describe <image> briefly.", [_png(0)]) == (6, 3, 3)
    assert engine.get_stats().prefix_cache_hits > 0


def test_an_image_cut_by_chunked_prefill_is_one_query(llava_path):
    engine = cpu_engine(llava_path, num_blocks=64, max_model_len=256, max_num_batched_tokens=8)
    assert _run(engine, "a", "Describe <image> briefly.", [_png(3)]) == (1, 0, 1)
